"""The files a run's training config makes its pods read, and whether each pod has them.

On Kubernetes a learner or syncer sees the image and what its pod template mounts, nothing else:
a `training.data.path` (memmap) or `training.model.initFrom` on a path no volume provides fails
the container at start with exit 2 and the unit crash-loops. So such a run is refused at
admission instead (the CRD's rule below, and `parse_spec(..., pods=True)` in the operator), with
the field and the path named. The local runtime reads the same manifests from the machine's own
files, where any path (relative ones too) is fine: it does not ask for this check.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from diloco_trainer.config import TrainingConfig

from diloco_operator.api.pod_template import PodTemplate

# Who reads, and the pod template they run with: ("the unitGroups[0] learners", template).
Readers = Sequence[tuple[str, PodTemplate | None]]

# What the trainer images hold of their own (docker/trainer*.Dockerfile): the virtual environment
# and the user's HOME; data baked into an image built from them belongs there.
IMAGE_DIRS = ("/opt/diloco", "/home/diloco")


def under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def mounted(path: str, template: PodTemplate | None) -> bool:
    """Whether the template's main container has a mount at or above `path`."""
    main = template.main_container if template else None
    mounts = (main.volume_mounts if main else None) or []
    return any(under(path, m.mount_path) for m in mounts)


def _where_read(
    training: TrainingConfig, learners: Readers, syncer: Readers
) -> Iterator[tuple[str, str, str, PodTemplate | None]]:
    """(field, path, which pods, their template) for each local path a container reads."""
    data = training.data
    if data.entrypoint is None and data.source == "memmap" and data.path:
        for who, template in [*learners, *syncer]:  # the syncer evaluates on the held-out tail
            yield "training.data.path", data.path, who, template
    if training.model.init_from:
        for who, template in syncer:
            yield "training.model.initFrom", training.model.init_from, who, template


def unprovided(training: TrainingConfig, learners: Readers, syncer: Readers) -> list[str]:
    """One line per path some pod of the run reads but does not have (`syncer`: empty for a
    run whose syncer is elsewhere)."""
    problems = []
    for field, path, who, template in _where_read(training, learners, syncer):
        if path.startswith("gs://"):
            continue  # read from the bucket, not the file system
        if not path.startswith("/"):
            problems.append(f"{field}: {path} is relative: a pod has no directory to resolve it in")
        elif not any(under(path, d) for d in IMAGE_DIRS) and not mounted(path, template):
            problems.append(
                f"{field}: {path}: no volume of {who} is mounted there (add the volume and its "
                "mount to their template, or keep the file under /home/diloco in your image)"
            )
    return problems


def _cel_under(path: str, directory: str) -> str:
    return f"({path} == {directory} || {path}.startsWith({directory} + '/'))"


def _cel_mounted(path: str, template: str) -> str:
    mounts = f"{template}.mainContainer.volumeMounts"
    return (
        f"(has({template}) && has({template}.mainContainer) && has({mounts}) && "
        f"{mounts}.exists(m, {_cel_under(path, 'm.mountPath')}))"
    )


def _cel_provided(path: str, readers: str) -> str:
    image = " || ".join(_cel_under(path, repr(d)) for d in IMAGE_DIRS)
    return f"{path}.startsWith('gs://') || ({path}.startsWith('/') && ({image} || {readers}))"


def cel_rules() -> list[dict[str, str]]:
    """unprovided() as rules on the run's spec, for the CRD."""
    data, model = "self.training.data", "self.training.model"
    memmap = (
        f"has({data}.source) && {data}.source == 'memmap' && has({data}.path) && "
        f"!has({data}.entrypoint)"
    )
    learners = (
        "has(self.unitGroups) && self.unitGroups.all(g, (has(g.remote) && g.remote) || "
        f"{_cel_mounted(data + '.path', 'g.template')})"
    )
    away = "(has(self.syncer) && has(self.syncer.external))"

    def syncer(path: str) -> str:
        return f"{away} || (has(self.syncer) && {_cel_mounted(path, 'self.syncer.template')})"

    why = "mount the volume holding it in the template of every pod that reads it"
    return [
        {
            "rule": f"!(has({data}) && {memmap}) || ({_cel_provided(data + '.path', learners)})",
            "message": f"training.data.path: no volume of the learners is mounted there; {why}",
            "fieldPath": ".training.data.path",
        },
        {
            "rule": f"!(has({data}) && {memmap}) || "
            f"({_cel_provided(data + '.path', syncer(data + '.path'))})",
            "message": f"training.data.path: no volume of the syncer is mounted there; {why}",
            "fieldPath": ".training.data.path",
        },
        {
            "rule": f"!(has({model}) && has({model}.initFrom)) || "
            f"({_cel_provided(model + '.initFrom', syncer(model + '.initFrom'))})",
            "message": f"training.model.initFrom: no volume of the syncer is mounted there; {why}",
            "fieldPath": ".training.model.initFrom",
        },
    ]

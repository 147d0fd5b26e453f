"""Text to token shards and back: tokenizer training, streaming reads, shards the memmap source
reads, the manifest, the run-time checks against it, and the `diloco data` CLI."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from diloco_operator.cli import main as diloco_main
from diloco_trainer.config import TrainingConfig
from diloco_trainer.data import text
from diloco_trainer.data.corpus import DataError, open_stream
from diloco_trainer.data.shards import read_manifest, token_dtype
from diloco_trainer.data.text import (
    EOD_TOKEN,
    ShardJob,
    TextDataError,
    find_inputs,
    read_pieces,
    train_tokenizer,
    write_shards,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

WORDS = ["the", "syncer", "merges", "fragments", "while", "learners", "train", "on", "shards"]


def prose(seed: int, words: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)))
    return "\n".join(lines) + "\n"


@pytest.fixture()
def corpus(tmp_path: Path) -> tuple[list[Path], list[str]]:
    """Three files, four documents: a text file, a Python file, a JSONL file of two."""
    src = tmp_path / "src"
    src.mkdir()
    a = prose(1, 400) + "naïve café, 東京, emoji 🎉 and a literal <|endoftext|> in the text\n"
    b = "def f(x):\n    return x * 2  # ünïcode\n" * 40
    c = [prose(2, 200), "short one, no newline at the end"]
    (src / "a.txt").write_text(a)
    (src / "b.py").write_text(b)
    (src / "c.jsonl").write_text(
        "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(c)) + "\n\n"
    )
    return [src / "a.txt", src / "b.py", src / "c.jsonl"], [a, b, *c]


def cfg_for(directory: Path, vocab: int, dtype: str) -> TrainingConfig:
    return TrainingConfig.model_validate(
        {
            "totalSteps": 10,
            "model": {"seqLen": 16, "vocabSize": vocab},
            "data": {"source": "memmap", "path": str(directory), "dtype": dtype, "batchSize": 2},
        }
    )


def tokenised(tmp_path: Path, files: list[Path], shard_tokens: int = 700) -> Path:
    tokenizer = train_tokenizer(files, 400)
    out = tmp_path / "shards"
    write_shards(ShardJob(files, out, tokenizer.to_str(), EOD_TOKEN, shard_tokens))
    return out


def test_shards_read_back_through_the_memmap_source_decode_to_the_documents(
    tmp_path: Path, corpus: tuple[list[Path], list[str]]
) -> None:
    files, docs = corpus
    out = tokenised(tmp_path, files)
    manifest = read_manifest(out)
    assert manifest is not None
    assert len(manifest.shards) >= 2 and manifest.dtype == "uint16"
    assert all(s.tokens == 700 for s in manifest.shards[:-1])
    assert 0 < manifest.shards[-1].tokens <= 700
    assert [s.documents for s in manifest.sources] == [1, 1, 2] and manifest.documents == 4
    assert manifest.sources[0].path == str(files[0].resolve())
    tokenizer_bytes = (out / "tokenizer.json").read_bytes()
    assert manifest.tokenizer.sha256 == hashlib.sha256(tokenizer_bytes).hexdigest()

    stream = open_stream(cfg_for(out, manifest.vocab_size, manifest.dtype))
    assert len(stream) == manifest.tokens
    ids = stream.read(0, len(stream)).tolist()
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(ids, skip_special_tokens=False) == EOD_TOKEN.join(docs)
    # Only the three joins carry the end-of-document id; the literal one in a.txt is text.
    assert ids.count(manifest.tokenizer.eod_id) == 3
    assert manifest.vocab_size <= 400 and max(ids) < manifest.vocab_size


def test_long_files_are_read_in_pieces_that_join_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text, "READ_BLOCK", 7)  # blocks cut lines and multi-byte characters
    monkeypatch.setattr(text, "MAX_PIECE_CHARS", 50)
    body = "line one é\n" + "x" * 120 + "\nñ 🎉 end"
    path = tmp_path / "long.txt"
    path.write_text(body)
    pieces = list(read_pieces([path]))
    assert "".join(p.text for p in pieces) == body
    assert sum(p.read for p in pieces) == len(body.encode())
    assert next(p.starts_document for p in pieces if p.text) is True
    assert sum(p.starts_document for p in pieces) == 1
    assert max(len(p.text) for p in pieces) <= 50 + 7


def test_undecodable_and_malformed_inputs_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(TextDataError, match=r"latin1\.txt: not UTF-8 text \(near byte 3"):
        list(read_pieces([bad]))
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(TextDataError, match=r"rows\.jsonl:2: expected a JSON object"):
        list(read_pieces([rows]))


def test_find_inputs_walks_directories_and_rejects_empty_input(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "x.txt").write_text("x")
    (tmp_path / "d" / "y.md").write_text("y")
    (tmp_path / "d" / ".hidden.txt").write_text("h")
    assert find_inputs([tmp_path / "d"]) == [tmp_path / "d/sub/x.txt", tmp_path / "d/y.md"]
    assert find_inputs([tmp_path / "d"], "*.md") == [tmp_path / "d/y.md"]
    with pytest.raises(TextDataError, match="no input files"):
        find_inputs([tmp_path / "d"], "*.rst")
    with pytest.raises(TextDataError, match="missing: no such file"):
        find_inputs([tmp_path / "missing"])


def test_dtype_is_uint16_while_the_vocabulary_fits_else_uint32(tmp_path: Path) -> None:
    assert token_dtype(256) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"
    # A tokenizer with 70,000 ids: every byte, the end-of-document token, then filler words.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"w{i}": len(alphabet) + i for i in range(70_000 - len(alphabet) - 1)})
    vocab[EOD_TOKEN] = 69_999
    big = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    big.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    big.decoder = decoders.ByteLevel()
    big.add_special_tokens([EOD_TOKEN])
    docs = ["first doc", "second doc"]
    files = []
    for i, doc in enumerate(docs):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(doc)
    manifest = write_shards(ShardJob(files, tmp_path / "out", big.to_str(), EOD_TOKEN, 4))
    assert manifest.dtype == "uint32" and manifest.vocab_size == 70_000
    ids = open_stream(cfg_for(tmp_path / "out", 70_000, "uint32")).read(0, manifest.tokens)
    assert 69_999 in ids.tolist()
    assert big.decode(ids.tolist(), skip_special_tokens=False) == EOD_TOKEN.join(docs)


def test_a_run_whose_config_does_not_fit_the_shards_is_refused(
    tmp_path: Path, corpus: tuple[list[Path], list[str]]
) -> None:
    out = tokenised(tmp_path, corpus[0])
    manifest = read_manifest(out)
    assert manifest is not None
    with pytest.raises(
        DataError,
        match=rf"training\.model\.vocabSize 256 is smaller .* {manifest.vocab_size} tokens",
    ):
        open_stream(cfg_for(out, 256, "uint16"))
    with pytest.raises(
        DataError, match=r"training\.data\.dtype uint32 does not match the shards' uint16"
    ):
        open_stream(cfg_for(out, manifest.vocab_size, "uint32"))
    open_stream(cfg_for(out, manifest.vocab_size + 100, "uint16"))  # a larger model vocab is fine
    last = out / manifest.shards[-1].file
    last.write_bytes(last.read_bytes()[:-2])
    with pytest.raises(DataError, match="incomplete copy"):
        open_stream(cfg_for(out, manifest.vocab_size, "uint16"))


def test_local_run_refuses_a_too_small_vocabulary_before_starting(
    tmp_path: Path, corpus: tuple[list[Path], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    out = tokenised(tmp_path, corpus[0])
    doc = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DilocoRun",
        "metadata": {"name": "t"},
        "spec": {
            "image": "local",
            "replicas": 1,
            "training": {
                "model": {"preset": "tiny", "vocabSize": 256},
                "data": {"source": "memmap", "path": str(out), "dtype": "uint16"},
                "totalTokens": 1000,
            },
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    report = tmp_path / "report"
    assert diloco_main(["local", "run", str(path), "--report-dir", str(report)]) == 2
    assert "training.model.vocabSize 256 is smaller" in capsys.readouterr().err
    assert not report.exists()


# --- the CLI, as a user runs it ----------------------------------------------------------------


def data_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "diloco_operator.cli", "data", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_tokenize_then_inspect(tmp_path: Path, corpus: tuple[list[Path], list[str]]) -> None:
    files, docs = corpus
    out = tmp_path / "tok"
    done = data_cli(
        "tokenize", files[0].parent, "--out", out, "--train-vocab", "350", "--shard-tokens", "600"
    )
    assert done.returncode == 0, done.stderr
    assert "data: {source: memmap, path: " + str(out.resolve()) + ", dtype: uint16}" in done.stderr
    manifest = read_manifest(out)
    assert manifest is not None and len(manifest.shards) >= 2
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json", "tokenizer.json", *(s.file for s in manifest.shards)]
    )
    shown = data_cli("inspect", out, "--tokens", "20")
    assert shown.returncode == 0, shown.stderr
    assert f"{manifest.tokens:,} tokens in {len(manifest.shards)} shard(s)" in shown.stdout
    assert docs[0][:20] in shown.stdout  # a.txt comes first; 20 tokens cover 20 characters
    # Our own output is replaced by a second run (with the saved tokenizer): same tokens.
    again = data_cli("tokenize", *files, "--out", out, "--tokenizer", out / "tokenizer.json")
    assert again.returncode == 0, again.stderr
    replaced = read_manifest(out)
    assert replaced is not None and replaced.tokens == manifest.tokens and len(replaced.shards) == 1


def test_cli_bad_input_is_exit_2_and_writes_nothing(
    tmp_path: Path, corpus: tuple[list[Path], list[str]]
) -> None:
    files, _ = corpus
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    empty = tmp_path / "empty"
    empty.mkdir()
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(b"caf\xe9\n")
    good = tokenised(tmp_path, files)  # a tokenizer to use without training
    theirs = work / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    cases = {
        "no input files": ("tokenize", empty, "--out", out, "--train-vocab", "300"),
        "no such file": ("tokenize", tmp_path / "nope.txt", "--out", out, "--train-vocab", "300"),
        "must be between 257": ("tokenize", *files, "--out", out, "--train-vocab", "100"),
        # fails after the temporary output directory exists: it must go again
        "not UTF-8 text": (
            "tokenize",
            *files,
            latin,
            "--out",
            out,
            "--tokenizer",
            good / "tokenizer.json",
        ),
        "not empty and was not written by diloco": (
            "tokenize",
            *files,
            "--out",
            theirs,
            "--train-vocab",
            "300",
        ),
        "has no such token": (
            "tokenize",
            *files,
            "--out",
            out,
            "--tokenizer",
            good / "tokenizer.json",
            "--eod-token",
            "<eos>",
        ),
        "not a tokenizers JSON file": ("tokenize", *files, "--out", out, "--tokenizer", files[0]),
    }
    for message, args in cases.items():
        done = data_cli(*args)
        assert done.returncode == 2, (message, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr
        assert sorted(p.name for p in work.iterdir()) == ["theirs"], message
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]
    assert data_cli("inspect", tmp_path / "src").returncode == 2


def test_the_syncer_refuses_a_too_small_vocabulary_at_start(
    tmp_path: Path, corpus: tuple[list[Path], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from diloco_trainer.syncer import main as syncer_main

    out = tokenised(tmp_path, corpus[0])
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg_for(out, 256, "uint16").to_wire()))
    args = ["--config", str(config), "--token", "t", "--checkpoint-dir", str(tmp_path / "c")]
    assert syncer_main.main(args) == 2
    assert "training.model.vocabSize 256 is smaller" in capsys.readouterr().err

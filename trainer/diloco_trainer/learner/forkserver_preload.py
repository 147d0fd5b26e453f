"""Imported first by the local runtime's fork server (and by nothing else): it ties the server's
life to the supervisor's.

`multiprocessing` starts the fork server with a plain exec, so unlike the runtime's other
children it would outlive a supervisor killed by SIGKILL. PDEATHSIG is cleared in forked
children, which set their own (they die with the server), so the chain supervisor -> fork server
-> learners leaves no orphan whichever of them dies.
"""

from diloco_trainer.learner.lifetime import die_with_parent

die_with_parent()

"""``torchrun ARGS`` as the leader of a process group of its own, for a warm parent
(warm.py) to fork: what the ``torchrun`` command runs (``torch.distributed.run``'s
``main``), after ``setpgid``.

With ``--run-path --start-method fork`` torchrun's agent forks each worker from
itself and runs the script there (``runpy.run_path``), instead of starting a new
interpreter per worker: in a child of a warm parent the workers start with torch and
the framework imported. They stay in the launcher's group, so one ``killpg`` of it
SIGKILLs the whole job (:class:`jobs.Job`'s ``kill``), as a lost node does.
"""

import os
import sys

from torch.distributed.run import main

if __name__ == "__main__":
    os.setpgid(0, 0)
    sys.exit(main())

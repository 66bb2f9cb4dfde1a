"""``python -m slurm_elastic`` is the ``slurm-elastic`` command.

``python -m slurm_elastic worker -- CMD ...``, the form the controller starts each worker step
with, goes straight to the step's entry without the click layer: every launch waits on it.
"""

import sys

if sys.argv[1:3] == ["worker", "--"] and len(sys.argv) > 3:
    from slurm_elastic.worker.step import main as step_main

    step_main(sys.argv[3:])
else:
    from slurm_elastic.cli import main

    main()

"""``python -m trainer [flags]`` = ``asyncrl trainer [flags]``.

For launchers that want a module or a script rather than a console entry point:
``deepspeed --num_gpus N --module trainer --config F`` (the launcher's ``--local_rank=K``
argument is ignored; LOCAL_RANK is in the environment) or ``torchrun ... -m trainer --config F``.
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

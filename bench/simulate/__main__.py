"""``python -m bench.simulate ...`` (from the repository root), or ``python bench/simulate ...``."""

import sys

if __package__ in (None, ""):  # ``python bench/simulate ...``: the folder was run, not the package
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.simulate.cli import main
else:
    from .cli import main

sys.exit(main())

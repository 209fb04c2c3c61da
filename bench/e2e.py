"""End-to-end benchmark, as a script: `python3 bench/e2e.py --help` (the same as `gptoss-max bench`).

All of it lives in src/gptoss_max/e2e.py; this only makes it runnable from a checkout where the
package is not installed (e.g. a GPU machine with MAX on PYTHONPATH).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gptoss_max.e2e import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

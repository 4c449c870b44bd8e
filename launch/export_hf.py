"""`jaxrl-agent export-hf` for a checkout (flags: jaxrl_agent/cli/export_hf.py).

  python launch/export_hf.py --workdir runs/calculator_tiny [--step N] --out exported/
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from jaxrl_agent.cli import export_hf  # noqa: E402

if __name__ == "__main__":
    sys.exit(export_hf.run(sys.argv))

"""`jaxrl-agent train` for a checkout: on a laptop, a GPU host or every host of a TPU pod slice.

  python launch/tpu_run.py --config configs/calculator_tiny.py [--config.a.b=value ...] [--mode smoke]

Flags and multi-host use: jaxrl_agent/cli/train.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from jaxrl_agent.cli import train  # noqa: E402

if __name__ == "__main__":
    train.run()

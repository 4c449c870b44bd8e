"""`jaxrl-agent agent` for a checkout (flags: jaxrl_agent/cli/agent.py).

  python launch/agent.py --checkpoint runs/chain_tiny --env chain --difficulty 6
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from jaxrl_agent.cli import agent  # noqa: E402

if __name__ == "__main__":
    sys.exit(agent.run(sys.argv))

"""`jaxrl-agent env-server` for a checkout (flags: jaxrl_agent/cli/env_server.py).

  python launch/env_server.py --port 7100 --workers 8 [--host 127.0.0.1] [--import my_envs]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from jaxrl_agent.cli import env_server  # noqa: E402

if __name__ == "__main__":
    sys.exit(env_server.run(sys.argv))

"""`jaxrl-agent sampler-server` for a checkout (flags: jaxrl_agent/cli/sampler_server.py).

  python launch/sampler_server.py --config configs/calculator_tiny.py --port 9000 [--host 127.0.0.1]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from jaxrl_agent.cli import sampler_server  # noqa: E402

if __name__ == "__main__":
    sampler_server.run()

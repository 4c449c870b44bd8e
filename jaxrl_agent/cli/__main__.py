"""`python -m jaxrl_agent.cli <command> ...` (the same as the `jaxrl-agent` script)."""

import sys

from jaxrl_agent.cli import main

sys.exit(main())

"""``python -m guest_agent.ctl``."""

import sys

from . import main

sys.exit(main())

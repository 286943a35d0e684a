"""`python -m pyzipmoe` runs the zipmoe command."""

import sys

from .cli import main

sys.exit(main())

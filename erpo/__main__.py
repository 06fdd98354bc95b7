"""`python -m erpo ...` is the `erpo` command."""
import sys

from .cli import main

sys.exit(main())

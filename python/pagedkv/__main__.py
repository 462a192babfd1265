"""`python -m pagedkv ...` is the `pagedkv` command."""

import sys

from .cli import main

sys.exit(main())

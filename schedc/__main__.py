import sys

from schedc.cli import main

sys.exit(main())

import sys

from stride.cli import main

sys.exit(main())

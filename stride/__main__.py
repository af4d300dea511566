import sys

from stride.launch.cli import main

sys.exit(main())

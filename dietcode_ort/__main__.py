import sys

from dietcode_ort.cli import main

sys.exit(main())

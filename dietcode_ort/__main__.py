import sys

from dietcode_ort.cli import console

sys.exit(console())

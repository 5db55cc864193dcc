import sys

from tracefp4.formats.clib.loader import main

sys.exit(main())

import sys

from draft_service.server import main

sys.exit(main())

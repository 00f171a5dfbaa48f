import sys

from verify_service.server import main

sys.exit(main())

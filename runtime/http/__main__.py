import sys

from radixlm.runtime.http.main import main

sys.exit(main())

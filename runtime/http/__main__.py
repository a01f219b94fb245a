"""``python -m radixlm.runtime.http``: see `radixlm.runtime.http.main`."""

import sys

from radixlm.runtime.http.main import main

if __name__ == "__main__":
    sys.exit(main())

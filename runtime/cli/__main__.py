"""``python -m radixlm.runtime.cli``: the `radixlm` command."""

import sys

from radixlm.runtime.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())

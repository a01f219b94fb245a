"""radixlm.runtime.frontend: the process between clients and the engine (tokenize,
render chat templates, detokenize, stop strings, client routing). Entry: `run_frontend`."""

from radixlm.runtime.frontend.main import run_frontend

__all__ = ["run_frontend"]

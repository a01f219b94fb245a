"""radixlm.tokenizer: tokenizer loading, chat templates (full and delta), incremental
detokenization and stop strings. Imports `tokenizers` and jinja2 only (no transformers):
it runs in the engine's frontend process."""

from radixlm.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from radixlm.tokenizer.detokenizer import IncrementalDetokenizer
from radixlm.tokenizer.stop import StopStringMatcher, TokenStopMatcher
from radixlm.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopStringMatcher",
    "TokenStopMatcher",
    "Tokenizer",
]

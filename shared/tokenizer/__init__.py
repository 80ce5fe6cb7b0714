"""Tokenization for the gateway and engine: the model's tokenizer and chat template, incremental
detokenization and stop strings."""

from shared.tokenizer.chat import ChatTemplate
from shared.tokenizer.detokenizer import IncrementalDetokenizer
from shared.tokenizer.stop import StopStringMatcher
from shared.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "StopStringMatcher", "Tokenizer"]

"""Tokenizers compatible with llama.cpp (SentencePiece 'llama' and byte-level BPE 'gpt2' vocabularies)
and chat-template rendering."""

from tandem.tokenizer.chat_template import chat_template_from_metadata, render_chat
from tandem.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "chat_template_from_metadata", "render_chat"]

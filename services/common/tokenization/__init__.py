"""Chat templates, tokenization and tool-call parsing for token-in/token-out callers.

Pure and server-free, and shared: the proxy (token mode) and the embedded engine
(``services/engine``) both tokenize with it, so neither imports the other. Typical use::

    tok = ChatTokenizer.load(model_dir)
    prompt_ids = tok.render_ids(messages, tools)          # OpenAI-shaped messages
    reply = tok.parse_reply(output_ids, tools)            # reasoning, content, tool calls

Messages are OpenAI chat dicts: ``role``, ``content`` (string or text parts; image
parts for a vision model, ``images.py``),
``tool_calls`` (``[{id, type, function: {name, arguments}}]``), ``tool_call_id``,
``reasoning_content``.
"""

from services.common.tokenization.template import (
    TemplateRenderError,
    default_template,
    render_template,
)
from services.common.tokenization.tokenizer import ChatTokenizer, TokenizerLoadError
from services.common.tokenization.toolcalls import (
    ParsedReply,
    ParsedToolCall,
    parse_reply,
    parse_tool_call,
    split_reasoning,
)

__all__ = [
    "ChatTokenizer",
    "ParsedReply",
    "ParsedToolCall",
    "TemplateRenderError",
    "TokenizerLoadError",
    "default_template",
    "parse_reply",
    "parse_tool_call",
    "render_template",
    "split_reasoning",
]

"""A Qwen2.5-Instruct-style chat template with tools, written for tests and tiny models.

The layout of Qwen2.5's own template (our wording and code): the tool schemas as JSON lines inside
``<tools></tools>`` in the system turn, with the instruction to answer with ``<tool_call>`` blocks;
consecutive tool results as ``<tool_response>`` blocks in one user turn. A real Qwen2.5 checkpoint
ships its own template; this one lets a test build a tiny model that renders the same way.
"""

__all__ = ["QWEN25_STYLE_TEMPLATE"]

_SYSTEM = "You are a helpful assistant."
QWEN25_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}" + _SYSTEM + "{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}<|im_start|>system\n" + _SYSTEM + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% if not tools %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

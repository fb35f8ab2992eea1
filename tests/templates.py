# ruff: noqa: E501 (templates are text: their lines are as the model families write them)
"""Chat templates in the tool styles of the model families kvmesh renders natively, written
for these tests (not the models' own files): each renders ``tools``, an assistant's
``tool_calls`` and ``tool`` results the way its family's template does (shared/model/tools.py
names the forms), so the renderer, the grammar and the parser can be checked against them."""

from __future__ import annotations

# Qwen2.5 / Qwen3 style: ChatML, tools in the system turn, Hermes tags for calls and results.
QWEN = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function %}
{% if message.content or not loop.first %}
{% endif %}<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1 style: tools in the first user turn, a call is the whole assistant turn as
# {"name": ..., "parameters": ...}, results in an ipython turn.
LLAMA = """{{ bos_token }}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}
<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}{{ system }}<|eot_id|>
{%- for message in messages %}
{%- if loop.first and tools and message.role == 'user' %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{ raise_exception("This model only supports single tool-calls at once!") }}{% endif %}
{%- set call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{"name": "{{ call.name }}", "parameters": {{ call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# Mistral style: [INST] turns, tools before the last user turn, calls as one [TOOL_CALLS]
# list with 9-character ids, results in [TOOL_RESULTS].
MISTRAL = """{{ bos_token }}
{%- set users = messages | selectattr('role', 'equalto', 'user') | list %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and message == users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == 'system' %}[SYSTEM_PROMPT]{{ message.content }}[/SYSTEM_PROMPT]
{%- elif message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}
{%- if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {"hermes": QWEN, "llama3": LLAMA, "mistral": MISTRAL}

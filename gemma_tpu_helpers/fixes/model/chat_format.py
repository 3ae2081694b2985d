"""What the real Gemma 4 -it tokenizer files hold, for the tiny replica to copy: special tokens at their real ids,
named tokens, ``generation_config.json``, and chat templates. Plain data: no JAX, torch or transformers.

The templates are ours, from the documented behaviour of the published one, for the parts used here (no tools).
:data:`GEMMA3_CHAT_TEMPLATE` is Gemma 3's format, kept to show the port trap.
"""

from __future__ import annotations

# id -> token, as in google/gemma-4-31B-it's tokenizer.json (shared by E2B/E4B). Ids 0-2, 50, 105 and 106 are firm;
# the others agree across several independent published copies.
SPECIAL_TOKEN_IDS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
LAST_LOW_SPECIAL_ID = 106

# The multimodal tokens sit near the top of the real 262144 vocabulary: (real id, token). The config names them
# (boi/eoi/image/video/boa/eoa/audio_token_id); the replica keeps their order at the top of its own vocabulary.
MULTIMODAL_TOKENS: tuple[tuple[str, int, str], ...] = (
    ("boi_token_id", 255999, "<|image>"),
    ("boa_token_id", 256000, "<|audio>"),
    ("image_token_id", 258880, "<|image|>"),
    ("audio_token_id", 258881, "<|audio|>"),
    ("eoi_token_id", 258882, "<image|>"),
    ("eoa_token_index", 258883, "<audio|>"),
    ("video_token_id", 258884, "<|video|>"),
)

# tokenizer_config.json's named tokens (transformers' convert_gemma4_weights.py passes them as extra_special_tokens).
NAMED_TOKENS: dict[str, str] = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
    "sot_token": "<|turn>",
    "eot_token": "<turn|>",
    "soc_token": "<|channel>",
    "eoc_token": "<channel|>",
    "think_token": "<|think|>",
    "escape_token": '<|"|>',
    "str_token": "<|tool_response>",
    "etr_token": "<tool_response|>",
    "stc_token": "<|tool_call>",
    "etc_token": "<tool_call|>",
    "std_token": "<|tool>",
    "etd_token": "<tool|>",
}
# The escape token's id is not among the published facts; the replica gives it the first free low id.
ESCAPE_TOKEN = NAMED_TOKENS["escape_token"]

# The -it generation_config.json (the eos ids are <eos>, <turn|> and <|tool_response>).
GENERATION_CONFIG: dict = {
    "bos_token_id": 2,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 0.95,
    "top_k": 64,
}

# The real tokenizer_config.json's plain fields (besides the named tokens): no chat_template key (the template is
# its own chat_template.jinja file), no tokenizer.model, no special_tokens_map.json.
TOKENIZER_CONFIG: dict = {
    "tokenizer_class": "GemmaTokenizer",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "mask_token": "<mask>",
    "add_bos_token": False,
    "add_eos_token": False,
    "padding_side": "left",
}
# The files of the real -it checkpoint's tokenizer and processor (besides config.json and the weights).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ABSENT_FILES = ("tokenizer.model", "special_tokens_map.json")

_STRIP_THINKING = """\
{%- macro strip_thinking(text) -%}
  {%- set ns = namespace(out='') -%}
  {%- for part in text.split('<channel|>') -%}
    {%- set ns.out = ns.out + (part.split('<|channel>')[0] if '<|channel>' in part else part) -%}
  {%- endfor -%}
  {{- ns.out | trim -}}
{%- endmacro -%}
{%- macro text_of(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- else -%}
    {%- for item in content -%}
      {%- if item['type'] == 'text' -%}{{- item['text'] -}}
      {%- elif item['type'] == 'image' -%}{{- '\\n\\n<|image|>\\n\\n' -}}
      {%- elif item['type'] == 'audio' -%}{{- '<|audio|>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
"""

_BODY = """\
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if thinking or messages[0]['role'] in ['system', 'developer'] -%}
  {{- '<|turn>system\\n' -}}
  {%- if thinking -%}{{- '<|think|>' -}}{%- endif -%}
  {%- if messages[0]['role'] in ['system', 'developer'] -%}
    {{- text_of(messages[0]['content']) | trim -}}
    {%- set loop_messages = messages[1:] -%}
  {%- endif -%}
  {{- '<turn|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<|turn>' + role + '\\n' -}}
  {%- if role == 'model' -%}{{- strip_thinking(text_of(message['content'])) -}}
  {%- else -%}{{- text_of(message['content']) | trim -}}
  {%- endif -%}
  {{- '<turn|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|turn>model\\n' -}}
"""

# 26B / 31B: with thinking off, the generation prompt ends in an empty thought channel, which the rendered history
# turn does not have (so the generation prompt is not a prefix of the conversation).
GEMMA4_31B_CHAT_TEMPLATE = _STRIP_THINKING + _BODY + """\
  {%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""

# E2B / E4B: the same, with nothing after <|turn>model\\n.
GEMMA4_E_CHAT_TEMPLATE = _STRIP_THINKING + _BODY + """\
{%- endif -%}
"""

# Gemma 3's format: no system role (a system message is folded into the first user turn), <start_of_turn> /
# <end_of_turn>. Not in the Gemma 4 vocabulary: kept for the port-trap lesson and the tests.
GEMMA3_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
  {%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}
{%- for message in loop_messages -%}
  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
  {{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + message['content'] | trim + \
'<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""
GEMMA3_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")

CHAT_TEMPLATES = {"31b": GEMMA4_31B_CHAT_TEMPLATE, "e": GEMMA4_E_CHAT_TEMPLATE, "gemma3": GEMMA3_CHAT_TEMPLATE}

# processor_config.json of the -it checkpoints (the fields published copies agree on). Text-only steps never read it;
# it is in the replica so that a file-set check or a processor-aware tool meets what the real checkpoint holds.
PROCESSOR_CONFIG: dict = {
    "processor_class": "Gemma4Processor",
    "image_seq_length": 280,
    "audio_seq_length": 750,
    "audio_ms_per_token": 40,
    "image_processor": {
        "image_processor_type": "Gemma4ImageProcessor",
        "processor_class": "Gemma4Processor",
        "patch_size": 16,
        "max_soft_tokens": 280,
        "pooling_kernel_size": 3,
        "do_convert_rgb": True,
        "do_normalize": False,
        "do_rescale": True,
        "do_resize": True,
        "rescale_factor": 1 / 255,
    },
}

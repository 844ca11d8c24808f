"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` over a model's own call format, the grammar
that holds an output to that format, and the parser that reads the calls back out of the text.

The format comes from the model's chat template. Hermes' format, which Qwen's templates (and SDAR's, TraDo's, Qwen3.5's)
write, is the one known here: each call is a JSON object on its own lines between `<tool_call>` and `</tool_call>`,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders `tools` but writes another format, or that takes no tools at all, gets a clear error.

The grammar (llguidance's Lark, passed to the core as `grammar`): with `tool_choice` "required" or a named function,
the output is one call (several with `parallel_tool_calls`) whose `arguments` match that function's `parameters`
schema; with "auto", the text is free until it opens a call (a lazy lexeme ends at `<tool_call>`), and from there
the call is held to the schemas, so its JSON always parses; "none" adds no grammar and reads no calls.
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import InvalidRequestError
from .types import ToolCall

#: OpenAI's rule for a function's name.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The most tools one request may define (OpenAI's limit).
MAX_TOOLS = 128
#: The tool definitions' JSON, at most (what the template renders into the prompt, and what the grammar compiles).
MAX_TOOLS_BYTES = 256 * 1024
#: The layout of a call's JSON: one line, json.dumps's separators (what Hermes templates write with `tojson`).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ToolChoice = Union[str, Mapping[str, Any], None]


@dataclass(frozen=True)
class Format:
    """A tool-call format: the text around each call's JSON."""

    name: str
    open: str
    close: str


HERMES = Format("hermes", "<tool_call>\n", "\n</tool_call>")


def template_format(template: Optional[str]) -> Format:
    """The tool-call format the chat template writes, or an error saying why there is none."""
    if not template:
        raise InvalidRequestError("tools need a chat template, and this model has none")
    if "tools" not in template:
        raise InvalidRequestError("this model's chat template renders no tools (it never reads 'tools'): it was not "
                                  "made for tool calls")
    if "<tool_call>" in template:
        return HERMES
    raise InvalidRequestError("this model's chat template renders tools, but not in a call format this engine knows "
                              "(Hermes' <tool_call>{...}</tool_call>)")


def strict_schema(schema: Any) -> Any:
    """A JSON Schema whose objects take no properties beyond those they declare (OpenAI's strict mode), unless they
    say otherwise."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: Dict[str, Any] = {}
    for k, v in schema.items():
        if k in _SCHEMA_MAPS and isinstance(v, dict):  # name -> schema
            out[k] = {name: strict_schema(s) for name, s in v.items()}
        elif k in _VALUES:  # data, not schemas
            out[k] = v
        else:
            out[k] = strict_schema(v)
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples")


def check_tools(tools: Any) -> List[Dict[str, Any]]:
    """OpenAI's `tools`, checked: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}}; each name unique and OpenAI's shape, each `parameters` a JSON Schema object."""
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}}, got "
                                  f"{type(tools).__name__}")
    if not tools:
        raise InvalidRequestError("tools must not be empty (leave it out for no tools)")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(
                t.get("function"), Mapping):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                      f"\"parameters\": {{...}}}}}}")
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got "
                                      f"{json.dumps(name)[:80]}")
        if name in seen:
            raise InvalidRequestError(f"{where}.function.name: '{name}' is defined twice")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise InvalidRequestError(f"{where}.function.description must be a string")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object, got "
                                      f"{type(params).__name__}")
        out.append({"type": "function", "function": {**f, "parameters": params}})
    try:
        size = len(json.dumps(out))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"tools must be JSON: {e}") from None
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequestError(f"tools: {size} bytes of JSON, at most {MAX_TOOLS_BYTES}")
    return out


def choice(tool_choice: ToolChoice, tools: List[Dict[str, Any]]) -> Tuple[str, List[Dict[str, Any]]]:
    """`tool_choice` as a mode ("none", "auto", "required") and the functions the output may call."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", tools
    if tool_choice in ("none", "required"):
        return str(tool_choice), tools
    if isinstance(tool_choice, Mapping) and tool_choice.get("type", "function") == "function":
        f = tool_choice.get("function")
        name = f.get("name") if isinstance(f, Mapping) else None
        named = [t for t in tools if t["function"]["name"] == name]
        if not named:
            raise InvalidRequestError(f"tool_choice names the function {json.dumps(name)[:80]}, which tools does not "
                                      f"define (defined: {[t['function']['name'] for t in tools][:20]})")
        return "required", named
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, got {json.dumps(tool_choice)[:80]}")


def _lark_string(s: str) -> str:
    return json.dumps(s)


def grammar(fmt: Format, mode: str, tools: List[Dict[str, Any]], parallel: bool, open_is_token: bool) -> Optional[str]:
    """The Lark grammar of an output under `mode` ("auto" or "required"; None for "none"). `open_is_token`: the
    call's opening tag is one of the vocabulary's control tokens (named `<...>` in Lark), not text."""
    if mode == "none":
        return None
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "arguments": _arguments(t["function"])},
                        "required": ["name", "arguments"], "additionalProperties": False} for t in tools],
             "x-guidance": LAYOUT}
    tag = fmt.open.rstrip("\n")
    opening = tag if open_is_token else _lark_string(tag)
    after_open = fmt.open[len(tag):]
    body = f"%json {json.dumps(calls)}"
    rest = f'{_lark_string(after_open)} body {_lark_string(fmt.close)}' if after_open else f"body {_lark_string(fmt.close)}"
    if mode == "required":
        many = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {many}\ncall: {opening} {rest}\nbody: {body}\n"
    # auto: free text; a call once the text opens one (the lazy lexeme ends at the opening tag)
    if open_is_token:
        head = f"head: TEXT {opening}"
    else:
        head = f"head[lazy]: TEXT {opening}"
    calls_rule = "call*" if parallel else "call?"
    return (f"start: {calls_rule} end\nend: TEXT\nTEXT: /(.|\\n)*/\n{head}\ncall: head {rest}\nbody: {body}\n")


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, resolved: `tools`, checked, for the template (None without tools), `format` to read
    calls in (None: no calls read, without tools or with tool_choice "none"), `params` with the grammar the choice
    implies."""

    tools: Optional[List[Dict[str, Any]]]
    format: Optional[Format]
    params: Dict[str, Any]

    @property
    def tools_json(self) -> Optional[str]:
        return None if self.tools is None else json.dumps(self.tools, ensure_ascii=False)

    def messages(self, messages: Any) -> Any:
        return messages_for_template(messages)


def plan(template: Optional[str], is_control: Callable[[str], bool], tools: Any, tool_choice: ToolChoice,
         parallel: Optional[bool], params: Dict[str, Any]) -> ToolPlan:
    """`tools` / `tool_choice` / `parallel_tool_calls` on a model whose chat template is `template` (`is_control`:
    whether a text is one of its vocabulary's control tokens)."""
    if tools is None:
        if tool_choice not in (None, "none", "auto") or parallel is not None:
            raise InvalidRequestError("tool_choice and parallel_tool_calls need tools")
        return ToolPlan(None, None, params)
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {parallel!r:.40}")
    checked = check_tools(tools)
    fmt = template_format(template)
    mode, allowed = choice(tool_choice, checked)
    if mode == "none":
        return ToolPlan(checked, None, params)
    rf = params.get("response_format")
    given = [k for k in ("response_format", "grammar", "regex") if params.get(k) is not None
             and not (k == "response_format" and rf in ({"type": "text"}, '{"type": "text"}'))]
    if given:
        raise InvalidRequestError(f"tools (tool_choice '{mode}') and {' and '.join(given)} each constrain the output: "
                                  "give one of them (or tool_choice='none')")
    g = grammar(fmt, mode, allowed, parallel is not False, is_control(fmt.open.rstrip("\n")))
    return ToolPlan(checked, fmt, {**params, "grammar": g})


def _arguments(f: Mapping[str, Any]) -> Any:
    """A function's arguments schema as the grammar holds it: its `parameters`, in OpenAI's strict mode (no object
    takes properties it does not declare) with `"strict": true`."""
    return strict_schema(f["parameters"]) if f.get("strict") is True else f["parameters"]


def new_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse(fmt: Format, text: str) -> Tuple[Optional[str], List[ToolCall]]:
    """The content and the calls of a finished output. The content is the text outside the calls, its trailing
    whitespace dropped (None when nothing is left); without calls, the text as it is. A call whose JSON does not
    parse, or is not {"name", "arguments"}, stays in the content as text."""
    calls: List[ToolCall] = []
    content: List[str] = []
    tag, close = fmt.open.rstrip("\n"), fmt.close.lstrip("\n")
    pos = 0
    while True:
        a = text.find(tag, pos)
        if a < 0:
            content.append(text[pos:])
            break
        b = text.find(close, a)
        if b < 0:
            content.append(text[pos:])
            break
        call = _call(text[a + len(tag):b])
        if call is None:
            content.append(text[pos:b + len(close)])
        else:
            content.append(text[pos:a])
            calls.append(call)
        pos = b + len(close)
    joined = "".join(content)
    return (joined.rstrip() or None) if calls else joined, calls


def _call(inner: str) -> Optional[ToolCall]:
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments"),
                                                                                            dict):
        return None
    return ToolCall(new_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def messages_for_template(messages: Any) -> Any:
    """OpenAI's messages as chat templates read them: an assistant's `tool_calls[].function.arguments` parsed from
    JSON text to the object templates render with `tojson` (as transformers' chat templates expect)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return messages  # the core names what is wrong with it
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if not calls or not isinstance(calls, list):
            out.append(m)
            continue
        fixed = []
        for j, c in enumerate(calls):
            f = c.get("function") if isinstance(c, Mapping) else None
            args = f.get("arguments") if isinstance(f, Mapping) else None
            if isinstance(f, Mapping) and isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: "
                                              f"{args[:80]!r}") from None
                c = {**c, "function": {**f, "arguments": args}}
            fixed.append(c)
        out.append({**m, "tool_calls": fixed})
    return out


#: What a streamed call starts with under the grammar's layout, up to its arguments.
_HEAD = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')


class StreamParser:
    """Reads a streamed output's text as it arrives, as OpenAI streams a reply with tool calls: the content outside
    the calls, and for each call, once its name is out, a start (its index, id and name) and then its arguments in
    fragments. Text that might still become an opening tag or a call's end is held back until it is known."""

    def __init__(self, fmt: Format):
        self.tag, self.close = fmt.open.rstrip("\n"), fmt.close.lstrip("\n")
        self.buf = ""
        self.inside = False  # past an opening tag
        self.call: Optional[Tuple[int, str, str]] = None  # the open call's (index, id, name), once its name is out
        self.args = ""  # the open call's arguments streamed so far
        self.calls: List[ToolCall] = []
        self.held = ""  # trailing whitespace of the content, sent once more content follows it (see `parse`)

    def _content(self, text: str, out: List[Tuple[str, Any]]) -> None:
        text = self.held + text
        sent = text.rstrip()
        if sent:
            out.append(("content", sent))
        self.held = text[len(sent):]

    def feed(self, text: str) -> List[Tuple[str, Any]]:
        """Events for `text`: ("content", text), ("call", (index, id, name)), ("arguments", (index, fragment)). The
        content deltas join to what `parse` gives as the content."""
        self.buf += text
        out: List[Tuple[str, Any]] = []
        while True:
            if not self.inside:
                a = self.buf.find(self.tag)
                if a < 0:
                    keep = _partial_suffix(self.buf, self.tag)
                    if len(self.buf) > keep:
                        self._content(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                if a > 0:
                    self._content(self.buf[:a], out)
                self.buf, self.inside = self.buf[a + len(self.tag):], True
            if self.call is None:
                m = _HEAD.match(self.buf)
                if m is None:
                    if self.close in self.buf:  # not a call this parser reads: its text is content
                        b = self.buf.index(self.close) + len(self.close)
                        self._content(self.tag + self.buf[:b], out)
                        self.buf, self.inside = self.buf[b:], False
                        continue
                    return out
                self.call = (len(self.calls), new_id(), m.group(1))
                self.buf, self.args = self.buf[m.end():], ""
                out.append(("call", self.call))
            b = self.buf.find(self.close)
            if b < 0:
                # the arguments so far, less what may be the call's end ("}" and the text before the closing tag)
                hold = len(self.close) + 3
                if len(self.buf) > hold:
                    frag, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
                    self.args += frag
                    out.append(("arguments", (self.call[0], frag)))
                return out
            rest = self.buf[:b].rstrip()
            if rest.endswith("}"):
                rest = rest[:-1]
            if rest:
                self.args += rest
                out.append(("arguments", (self.call[0], rest)))
            index, cid, name = self.call
            self.calls.append(ToolCall(cid, name, self.args))
            self.buf, self.inside, self.call = self.buf[b + len(self.close):], False, None

    def finish(self) -> str:
        """Content left at the end: held-back text, or an opening tag whose call never started; the trailing
        whitespace too when the output made no call."""
        rest = self.buf if not self.inside else (self.tag + self.buf if self.call is None else "")
        self.buf = ""
        out: List[Tuple[str, Any]] = []
        self._content(rest, out)
        tail = "" if self.calls else self.held
        self.held = ""
        return "".join(v for _, v in out) + tail


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0

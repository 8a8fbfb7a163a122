"""Tool calls of the codebroker kernel: loaded by kernel.py (`part("tools")`) on the first
request that has tools, so a kernel whose code never calls a tool does not pay for it.

kernel.py gives this module, before it runs, what it shares with the kernel:
`flush_output`, `register_source` and `TOOL_PREFIX`.
"""

import sys

# --------------------------------------------------------------------------------------------
# Tools: functions that call the broker's tools over the exec's tool socket
# --------------------------------------------------------------------------------------------
#
# For each tool of a request the cell's globals get `async def NAME(*, param, ...)`: keyword-only
# parameters from the JSON Schema's `properties` (those in `required` have no default, the
# others default to None and are left out of the input when None), `**kwargs` when the schema
# allows more properties (or lists none), the description (and the properties' descriptions)
# as docstring. Calling it sends {"name": ..., "input": {...}} over a new connection to the
# socket and returns the answer's `result`, or raises ToolError with its `error_message`; so
# `await asyncio.gather(a(), b())` makes two calls at once.
#
# Names: characters that cannot be in an identifier become `_` (a leading digit gets `_` in
# front); a function name that is a keyword or a builtin (or ToolError) gets `_tool` appended,
# a parameter name that is a keyword gets `_` appended; duplicates get `_2`, `_3`, ...
#
# Before the next cell the functions and ToolError are removed from the globals again, unless
# the code bound the name to something else meanwhile.


class ToolError(RuntimeError):
    """A tool call failed: the tool reported an error, or the tool socket could not be used."""

    # Shown as `ToolError`, not under this module's name, in tracebacks; pickled by value as
    # the cells' own classes are.
    __module__ = "__main__"

    def __init__(self, message, tool=None):
        super().__init__(message)
        self.tool = tool


_JSON_TYPES = {
    "string": "str",
    "integer": "int",
    "number": "float",
    "boolean": "bool",
    "array": "list",
    "object": "dict",
    "null": "None",
}


def _identifier(name):
    """name with every character that cannot be in an identifier replaced by `_`."""
    if not isinstance(name, str):
        name = str(name)
    if not name.isascii():
        import unicodedata

        name = unicodedata.normalize("NFKC", name)  # as the parser would see it
    s = "".join(c if ("_" + c).isidentifier() else "_" for c in name)
    if not s.isidentifier():
        s = "_" + s  # empty, or starts with a digit
    return s if s.isidentifier() else "_"


def _unique(name, taken):
    candidate, n = name, 2
    while candidate in taken:
        candidate = "%s_%d" % (name, n)
        n += 1
    taken.add(candidate)
    return candidate


def tool_function_names(names):
    """The Python function names of tools called `names`, in order."""
    import builtins
    import keyword

    taken = set()
    out = []
    for name in names:
        ident = _identifier(name)
        if keyword.iskeyword(ident) or hasattr(builtins, ident) or ident == "ToolError":
            ident += "_tool"
        out.append(_unique(ident, taken))
    return out


def _json_default(value):
    """JSON for the values numpy, pandas and datetime hand out."""
    for attr in ("tolist", "isoformat"):
        method = getattr(value, attr, None)
        if callable(method):
            return method()
    if isinstance(value, (set, frozenset)):
        return list(value)
    raise TypeError("Object of type %s is not JSON serializable" % type(value).__name__)


# Calls started in the same turn of the event loop (`asyncio.gather(a(), b())`) are sent
# together once the turn ends, each naming the step and its size, so the broker answers
# them as one batch. One step at a time per event loop (threads may run their own loop).
_steps = {}
_step_count = [0]


async def _step_of_call():
    """Joins this turn's step; once the turn ends, its hint (None for a lone call)."""
    import asyncio

    loop = asyncio.get_running_loop()
    step = _steps.get(id(loop))
    if step is None:
        _step_count[0] += 1
        step = {"id": "py-%d" % _step_count[0], "size": 0, "done": loop.create_future()}
        _steps[id(loop)] = step

        def close():
            _steps.pop(id(loop), None)
            step["done"].set_result(None)

        loop.call_soon(close)
    step["size"] += 1
    await step["done"]
    return {"id": step["id"], "size": step["size"]} if step["size"] > 1 else None


async def call_tool(socket_path, name, payload):
    """One call over the tool socket: the result, or ToolError."""
    import asyncio
    import json

    if not socket_path:
        raise ToolError("Tool %r is not available: this exec has no tool socket" % name, name)
    batch = await _step_of_call()
    flush_output()  # what the code printed before the call comes before it
    request = {"name": name, "input": payload}
    if batch:
        request["batch"] = batch
    line = json.dumps(request, default=_json_default).encode() + b"\n"
    try:
        reader, writer = await asyncio.open_unix_connection(socket_path)
    except OSError as e:
        raise ToolError(
            "Tool %r is not available (tools only work during the exec that has them): %s"
            % (name, e.strerror or e), name
        ) from None
    try:
        writer.write(line)
        await writer.drain()
        data = await reader.read()
    except OSError as e:
        raise ToolError("Tool %r: the call failed: %s" % (name, e.strerror or e), name) from None
    finally:
        writer.close()
    try:
        answer = json.loads(data) if data else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ToolError("Tool %r: no answer (is the exec over?)" % name, name)
    if answer.get("is_error"):
        raise ToolError(answer.get("error_message") or "Tool %r failed" % name, name)
    return answer.get("result")


def _annotation(schema):
    kind = schema.get("type") if isinstance(schema, dict) else None
    return _JSON_TYPES.get(kind) if isinstance(kind, str) else None


def make_tool_function(func_name, tool, socket_path):
    """The async function for one tool spec; see the comment above."""
    import keyword

    name = tool["name"]
    description = tool.get("description")
    description = description if isinstance(description, str) else ""
    schema = tool.get("parameters")
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    required = set(r for r in required if isinstance(r, str)) if isinstance(required, list) else set()
    extra = schema.get("additionalProperties")  # absent: allowed, but not offered unless no props
    variadic = extra is not False if not props else (extra is True or isinstance(extra, dict))

    taken = set()
    params, req_items, opt_items, docs = [], [], [], []
    for prop, sub in props.items():
        ident = _identifier(prop)
        if keyword.iskeyword(ident):
            ident += "_"
        if ident.startswith("_codebroker"):
            ident += "_"
        ident = _unique(ident, taken)
        ann = _annotation(sub)
        if prop in required:
            params.append("%s: %s" % (ident, ann) if ann else ident)
            req_items.append("%r: %s" % (prop, ident))
        else:
            if ann and ann != "None" and sys.version_info >= (3, 10):
                params.append("%s: %s | None = None" % (ident, ann))
            else:
                params.append("%s=None" % ident)
            opt_items.append("%r: %s" % (prop, ident))
        text = sub.get("description") if isinstance(sub, dict) else None
        kind = (ann or "any") + ("" if prop in required else ", optional")
        text = " ".join(text.split()) if isinstance(text, str) else ""
        docs.append("    %s (%s)%s" % (ident, kind, ": " + text if text else ""))
    kwargs = _unique("kwargs", taken)
    signature = (["*"] + params if params else []) + (["**" + kwargs] if variadic else [])
    source = (
        "def _codebroker_make(_codebroker_call):\n"
        "    async def %s(%s):\n"
        "        return await _codebroker_call({%s}, {%s}, %s)\n"
        "    return %s\n"
        % (func_name, ", ".join(signature), ", ".join(req_items), ", ".join(opt_items),
           kwargs if variadic else "None", func_name)
    )

    async def call(required_input, optional_input, extra_input):
        payload = dict(extra_input or ())
        payload.update(required_input)
        payload.update((k, v) for k, v in optional_input.items() if v is not None)
        return await call_tool(socket_path, name, payload)

    filename = "%s%s>" % (TOOL_PREFIX, func_name)
    namespace = {"__builtins__": __builtins__}
    try:
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    except SyntaxError:  # cannot happen with sanitized names; keep the tool usable anyway
        source = (
            "def _codebroker_make(_codebroker_call):\n"
            "    async def %s(**kwargs):\n"
            "        return await _codebroker_call({}, {}, kwargs)\n"
            "    return %s\n" % (func_name, func_name)
        )
        docs = []
        exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    register_source(filename, source)
    func = namespace["_codebroker_make"](call)
    func.__qualname__ = func_name
    func.__module__ = "__main__"
    doc = description.strip()
    if docs:
        doc = (doc + "\n\n" if doc else "") + "Args:\n" + "\n".join(docs)
    func.__doc__ = doc or None
    func.tool_name = name
    func.tool_parameters = schema
    return func

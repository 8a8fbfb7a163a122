async def __codemode_main():
    import ast as _ast, inspect as _inspect, json as _json, types as _types
    _g = globals()
    _report = None
    _root = _types.SimpleNamespace()
    for _key, _f in list(_g.items()):
        _name = getattr(_f, "tool_name", None)
        if not isinstance(_name, str) or not callable(_f):
            continue
        if _name == @REPORT@:
            _report = _f
            del _g[_key]
            continue
        _ns, _dot, _rest = _name.partition(".")
        if not _dot:
            setattr(_root, _name, _f)
            continue
        _space = getattr(_root, _ns, None)
        if _space is None:
            _space = _types.SimpleNamespace()
            setattr(_root, _ns, _space)
        setattr(_space, _rest, _f)
    _g["codemode"] = _root
    _value, _error = None, None
    try:
        _tree = _ast.parse(@SOURCE@, "<code>")
        if _tree.body and isinstance(_tree.body[-1], _ast.Expr):
            _tree.body[-1] = _ast.Assign(
                targets=[_ast.Name(id="__codemode_value", ctx=_ast.Store())],
                value=_tree.body[-1].value,
            )
            _ast.fix_missing_locations(_tree)
        _code = compile(_tree, "<code>", "exec", flags=_ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        _r = eval(_code, _g)
        if _inspect.iscoroutine(_r):
            await _r
        _value = _g.pop("__codemode_value", None)
        if _inspect.isawaitable(_value):
            _value = await _value
        try:
            _json.dumps(_value)
        except (TypeError, ValueError):
            _value = repr(_value)
    except Exception as _e:
        _error = "%s: %s" % (type(_e).__name__, _e)
    if _report is not None:
        await _report(value=_value, error=_error)

await __codemode_main()
del __codemode_main

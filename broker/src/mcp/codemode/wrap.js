const __codemode_AsyncFunction = (async () => {}).constructor;
const __codemode_params = ["require", "module", "exports", "__filename", "__dirname"];
let __codemode_value = null, __codemode_error = null;
try {
  let fn;
  try {
    fn = new __codemode_AsyncFunction(...__codemode_params, "return (\n" + @SOURCE@ + "\n);");
  } catch (e) {
    if (!(e instanceof SyntaxError)) throw e;
    fn = new __codemode_AsyncFunction(...__codemode_params, @SOURCE@);
  }
  let value = await fn(require, module, exports, __filename, __dirname);
  if (typeof value === "function") value = await value();
  __codemode_value = __codemode_safe(value);
} catch (e) {
  __codemode_error = __codemode_message(e);
}
await __codemode_report({ value: __codemode_value, error: __codemode_error });

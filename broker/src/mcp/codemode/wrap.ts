let __codemode_value: any = null, __codemode_error: any = null;
try {
  let value: any = await (async () => {
@CODE@
  })();
  if (typeof value === "function") value = await value();
  __codemode_value = __codemode_safe(value);
} catch (e) {
  __codemode_error = __codemode_message(e);
}
await __codemode_report({ value: __codemode_value, error: __codemode_error });

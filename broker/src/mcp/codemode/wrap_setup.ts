const __codemode_report: any = (() => {
  const cm: any = (globalThis as any).codemode;
  const report = cm[@REPORT@];
  delete cm[@REPORT@];
  for (const key of Object.keys(globalThis)) {
    if ((globalThis as any)[key] === report) delete (globalThis as any)[key];
  }
  for (const key of Object.keys(cm)) {
    const dot = key.indexOf(".");
    if (dot < 1) continue;
    const ns = key.slice(0, dot);
    if (cm[ns] === undefined) cm[ns] = {};
    if (typeof cm[ns] === "object" && cm[ns][key.slice(dot + 1)] === undefined) {
      cm[ns][key.slice(dot + 1)] = cm[key];
    }
  }
  return report;
})();
const __codemode_safe = (v: any) => {
  if (v === undefined) return null;
  try {
    const text = JSON.stringify(v);
    return text === undefined ? String(v) : JSON.parse(text);
  } catch (e) {
    return String(v);
  }
};
const __codemode_message = (e: any) =>
  e instanceof Error ? `${e.name}: ${e.message}` : String(e);

// Programmatic tool calling (POST /exec/programmatic) through LibreChat's real client: the
// code the model writes calls the agent's tools, the broker hands each batch of calls back
// to the client, the client runs them (its toolMap) and continues the run with the results.
//
// How LibreChat wires it (packages/api/src/tools/classification.ts): the agent's tools whose
// `allowed_callers` include 'code_execution' go into the ToolNode's `toolRegistry`; the
// ToolNode injects `toolMap` (the LangChain tool instances) and `toolDefs` (their
// {name, description, parameters, ...} definitions) into `config.toolCall` of the
// programmatic tool (src/tools/ToolNode.ts getProgrammaticTools). Current LibreChat creates
// the bash variant, `createBashProgrammaticToolCallingTool({ authHeaders })`; the Python
// one, `createProgrammaticToolCallingTool`, is the same loop with `lang` left out (py).
// Here the ToolNode runs them exactly so: tools created with each generation's own
// @langchain/core `tool()`, the registry marking them 'code_execution'.
//
// What the client sends (src/tools/ProgrammaticToolCalling.ts makeRequest / the factory):
//   first:         POST {base}/exec/programmatic {code, tools: toolDefs, session_id?, timeout, files?}
//                  (+ lang: 'bash' for the bash tool, whose code starts with `: &\nwait "$!"`)
//   continuation:  POST {base}/exec/programmatic {continuation_token, tool_results:
//                  [{call_id, result, is_error, error_message?}]}
// until `status` is 'completed' (formatted like execute_code: "stdout:\n...") or 'error'
// (thrown: the ToolMessage is an error). At most 20 round trips (maxRoundTrips).
// Per generation:
//   3.9.x   authHeaders() on every request (LibreChat's EdDSA JWT). Only with a `signal`:
//           a fresh `X-LibreChat-Code-Request-ID` per request; on abort,
//           POST {base}/exec/programmatic/cancel {request_id} (best effort, 2 s).
//           timeout: the model's value clamped to [1000, LIBRECHAT_CODE_API_RUN_TIMEOUT_MS
//           (15000 by default)]; tools: all code_execution tools, or the `tool_manifest`.
//   3.1.77  NO credentials at all (makeRequest sends Content-Type and User-Agent only), so
//           its tests run against a second broker started with CODEBROKER_AUTH=none.
//           timeout 60000 by default; tools filtered to the names the code mentions.
//   3.0.50  `X-API-Key` (createProgrammaticToolCallingTool({ apiKey })); Python only.
// The plain-HTTP tests at the end cover what no package sends: JavaScript, the cancel route
// named by its request id, and what happens to a run whose client is slow.

import { test, describe, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { performance } from 'node:perf_hooks';
import { startBroker } from '../lib/broker.mjs';
import { recordingProxy, call, show, ID_RE } from '../lib/http.mjs';
import { loadAgents, toolRunner, contentText } from '../lib/agents.mjs';

const USER = '665f1c2e9b1e8a0012345610';
const PTC_PATH = '/v1/exec/programmatic';

let broker; // key + JWT: 3.9.x (JWT), 3.0.50 (X-API-Key), plain HTTP
let proxy;
let lc; // 3.9.x
let classic; // 3.0.50

before(async () => {
  broker = await startBroker({ jwt: true });
  proxy = await recordingProxy(broker.root);
  process.env.LIBRECHAT_CODE_BASEURL = `${proxy.url}/v1`;
  lc = await loadAgents('@librechat/agents');
  classic = await loadAgents('librechat-agents-classic');
});

after(async () => {
  await proxy?.close();
  await broker?.stop();
});

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---------------------------------------------------------------------------------------
// The agent's tools, as LangChain tools of one generation
// ---------------------------------------------------------------------------------------

const NUM2 = {
  type: 'object',
  properties: { a: { type: 'number', description: 'first operand' }, b: { type: 'number', description: 'second operand' } },
  required: ['a', 'b'],
};
const TOOL_DEFS = {
  add: { description: 'Adds two numbers.', parameters: NUM2 },
  mul: { description: 'Multiplies two numbers.', parameters: NUM2 },
  weather: {
    description: 'Current weather of a city (an MCP tool: text content holding JSON).',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
  },
  fail: {
    description: 'Always fails.',
    parameters: { type: 'object', properties: { reason: { type: 'string' } }, required: ['reason'] },
  },
  slow: {
    description: 'Answers after `ms` milliseconds.',
    parameters: { type: 'object', properties: { ms: { type: 'integer' } }, required: ['ms'] },
  },
};
const TEMPS = { Oslo: 4, Rome: 18, Cairo: 27 };

/**
 * The tools of one agent for generation `gen`, recording every call the client makes
 * ({name, input, start, end} in ms): `add`, `mul` (plain tools returning numbers),
 * `weather` (shaped like LibreChat's MCP tools: `mcp = true`, content_and_artifact, the
 * content a text block of JSON, which the client unwraps), `fail` (throws), `slow`.
 */
function hostTools(gen) {
  const calls = [];
  const recorded = (name, fn) => async (input) => {
    const c = { name, input, start: performance.now() };
    calls.push(c);
    try {
      return await fn(input);
    } finally {
      c.end = performance.now();
    }
  };
  const make = (name, fn, extra = {}) =>
    gen.tools.tool(recorded(name, fn), { name, description: TOOL_DEFS[name].description, schema: TOOL_DEFS[name].parameters, ...extra });
  const weather = make(
    'weather',
    async ({ city }) => [[{ type: 'text', text: JSON.stringify({ city, temp_c: TEMPS[city] ?? null }) }], undefined],
    { responseFormat: 'content_and_artifact' },
  );
  weather.mcp = true;
  const list = [
    make('add', async ({ a, b }) => {
      await sleep(50);
      return a + b;
    }),
    make('mul', async ({ a, b }) => {
      await sleep(50);
      return a * b;
    }),
    weather,
    make('fail', async ({ reason }) => {
      throw new Error(`disk on fire (${reason})`);
    }),
    make('slow', async ({ ms }) => {
      await sleep(ms);
      return 'slept';
    }),
  ];
  // What LibreChat's buildToolRegistryFromAgentOptions makes of the agent's tool_options.
  const toolRegistry = new Map(
    list.map((t) => [t.name, { name: t.name, ...TOOL_DEFS[t.name], allowed_callers: ['code_execution'] }]),
  );
  return { list, calls, toolRegistry };
}

/** A ToolNode holding `ptcTool` and the agent's tools, as LibreChat's graph builds it. */
function ptcRunner(gen, ptcTool, sessions = new Map()) {
  const host = hostTools(gen);
  const runner = toolRunner(gen, [ptcTool, ...host.list], sessions, { toolRegistry: host.toolRegistry });
  return { ...runner, calls: host.calls, name: ptcTool.name };
}

/** The programmatic requests the client sent since `mark` (through `p`). */
function ptcRequests(p, mark) {
  return p.since(mark).filter((e) => e.method === 'POST' && e.url === PTC_PATH);
}

/** The batches of tool calls the broker handed out, in order. */
function batches(exchanges) {
  return exchanges.filter((e) => e.response?.status === 'tool_call_required').map((e) => e.response.tool_calls);
}

/** Checks the request/answer chain of one run: each continuation names the token just given, with one result per call. */
function assertChain(exchanges) {
  assert.ok(exchanges.length >= 1);
  assert.equal(exchanges[0].body.continuation_token, undefined);
  const tokens = new Set();
  for (let i = 1; i < exchanges.length; i += 1) {
    const prev = exchanges[i - 1].response;
    const { body } = exchanges[i];
    assert.equal(prev.status, 'tool_call_required', JSON.stringify(prev));
    assert.match(prev.continuation_token, ID_RE);
    assert.ok(!tokens.has(prev.continuation_token), 'each round trip gets a new token');
    tokens.add(prev.continuation_token);
    assert.deepEqual(Object.keys(body).sort(), ['continuation_token', 'tool_results']);
    assert.equal(body.continuation_token, prev.continuation_token);
    assert.deepEqual(body.tool_results.map((r) => r.call_id).sort(), prev.tool_calls.map((c) => c.id).sort());
  }
  for (const e of exchanges) assert.equal(e.status, 200, JSON.stringify(e.response));
}

const jwtHeaders = (user = USER) => () => ({ Authorization: `Bearer ${broker.mintJwt(user)}` });

// ---------------------------------------------------------------------------------------
// @librechat/agents 3.9.x (LibreChat v0.8.5+), authenticated with LibreChat's JWT
// ---------------------------------------------------------------------------------------

function currentPtc(opts = {}) {
  return lc.agents.createProgrammaticToolCallingTool({ authHeaders: jwtHeaders(), ...opts });
}
function currentBashPtc(opts = {}) {
  return lc.agents.createBashProgrammaticToolCallingTool({ authHeaders: jwtHeaders(), ...opts });
}

test('3.9.x: the package has both programmatic tools and reads LIBRECHAT_CODE_BASEURL', () => {
  assert.match(lc.version, /^3\.9\./);
  assert.equal(lc.agents.Constants.PROGRAMMATIC_TOOL_CALLING, 'run_tools_with_code');
  assert.equal(lc.agents.Constants.BASH_PROGRAMMATIC_TOOL_CALLING, 'run_tools_with_bash');
  assert.equal(currentPtc().name, 'run_tools_with_code');
  assert.equal(currentBashPtc().name, 'run_tools_with_bash');
  assert.equal(lc.agents.getCodeBaseURL(), `${proxy.url}/v1`);
});

test('3.9.x Python: sequential calls, one per round trip; the JWT on every request; tool defs and results as sent', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const code = 's = await add(a=2, b=3)\np = await mul(a=s, b=4)\nprint("sum", s, "product", p)';
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\nsum 5 product 20');
  assert.match(msg.artifact.session_id, ID_RE);

  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  assert.equal(ex.length, 3);
  const first = ex[0];
  assert.deepEqual(Object.keys(first.body).sort(), ['code', 'timeout', 'tools']);
  assert.equal(first.body.code, code);
  assert.equal(typeof first.body.timeout, 'number');
  // No tool_manifest: every code_execution tool of the agent goes, with its registry fields.
  assert.deepEqual(first.body.tools.map((t) => t.name), ['add', 'mul', 'weather', 'fail', 'slow']);
  assert.deepEqual(first.body.tools[0], { name: 'add', ...TOOL_DEFS.add, allowed_callers: ['code_execution'] });
  for (const e of ex) {
    assert.match(e.headers.authorization, /^Bearer [\w-]+\.[\w-]+\.[\w-]+$/);
    assert.equal(e.headers['user-agent'], 'LibreChat/1.0');
    assert.equal(e.headers['x-librechat-code-request-id'], undefined, 'no request id without a signal');
  }
  assert.deepEqual(batches(ex), [
    [{ id: batches(ex)[0][0].id, name: 'add', input: { a: 2, b: 3 } }],
    [{ id: batches(ex)[1][0].id, name: 'mul', input: { a: 5, b: 4 } }],
  ]);
  assert.deepEqual(ex[1].body.tool_results, [{ call_id: batches(ex)[0][0].id, result: 5, is_error: false }]);
  assert.deepEqual(ex[2].body.tool_results, [{ call_id: batches(ex)[1][0].id, result: 20, is_error: false }]);
  assert.equal(ex[2].response.status, 'completed');
  assert.deepEqual(r.calls.map((c) => c.name), ['add', 'mul']);
});

test('3.9.x Python: a file the run could not keep brings the client\'s artifact delivery warning', async () => {
  const r = ptcRunner(lc, currentPtc());
  // 11 MiB is over CODEBROKER_MAX_OUTPUT_FILE_MB (10): one of the two files is not kept.
  const code = [
    's = await add(a=1, b=2)',
    "open('/mnt/data/big.bin', 'wb').write(bytes(11 * 1024 * 1024))",
    "open('/mnt/data/sum.txt', 'w').write(str(s))",
    'print("sum", s)',
  ].join('\n');
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  const text = contentText(msg);
  assert.match(text, /^stdout:\nsum 3\n/);
  assert.ok(
    text.includes(
      'Artifact delivery warning: 1 of 2 generated files could not be persisted. Do not assume missing files are available to later calls or downloadable.',
    ),
    text,
  );
  assert.deepEqual(msg.artifact.artifact_delivery, {
    code: 'artifact_delivery_failed',
    status: 'partial',
    attempted: 2,
    delivered: 1,
    failed: 1,
  });
  assert.deepEqual(msg.artifact.files.map((f) => f.name), ['sum.txt']);
});

test('3.9.x Python: asyncio.gather sends the calls in one batch, and the client runs them at once', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const code = [
    'import asyncio',
    'a, m, w = await asyncio.gather(add(a=1, b=2), mul(a=3, b=4), weather(city="Rome"))',
    'print(a, m, w["temp_c"], type(w).__name__)',
  ].join('\n');
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\n3 12 18 dict');
  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  const b = batches(ex);
  assert.equal(b.length, 1, `one round trip for the three calls: ${JSON.stringify(b)}`);
  assert.deepEqual(b[0].map((c) => c.name).sort(), ['add', 'mul', 'weather']);
  assert.equal(new Set(b[0].map((c) => c.id)).size, 3);
  // The MCP tool's text block reached the code as the object it holds.
  const w = ex[1].body.tool_results.find((x) => x.call_id === b[0].find((c) => c.name === 'weather').id);
  assert.deepEqual(w.result, { city: 'Rome', temp_c: 18 });
  // executeTools runs a batch with Promise.all: every call started before any ended.
  const lastStart = Math.max(...r.calls.map((c) => c.start));
  const firstEnd = Math.min(...r.calls.map((c) => c.end));
  assert.ok(lastStart < firstEnd, `calls overlapped: ${JSON.stringify(r.calls)}`);
});

test('3.9.x Python: the tool description\'s own parallel example (asyncio.gather without an import) works', async () => {
  // ProgrammaticToolCallingDescription: "sf, ny = await asyncio.gather(get_weather(city="SF"), ...)";
  // LibreChat's Code API wraps the code in a module that has imported asyncio.
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const code = 'oslo, cairo = await asyncio.gather(weather(city="Oslo"), weather(city="Cairo"))\nprint(f"Oslo: {oslo[\'temp_c\']}, Cairo: {cairo[\'temp_c\']}")';
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\nOslo: 4, Cairo: 27');
  assert.equal(batches(ptcRequests(proxy, mark)).length, 1);
});

test('3.9.x Python: a tool that throws reaches the code as an exception it can catch', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const code = [
    'try:',
    '    await fail(reason="test")',
    'except Exception as e:',
    '    print("caught", type(e).__name__, e)',
    'print("after", await add(a=1, b=1))',
  ].join('\n');
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout:\ncaught \w+ disk on fire \(test\)\nafter 2$/);
  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  assert.deepEqual(ex[1].body.tool_results, [
    { call_id: batches(ex)[0][0].id, result: null, is_error: true, error_message: 'disk on fire (test)' },
  ]);
});

test('3.9.x Python: an uncaught tool error ends the run with status error; the ToolMessage is an error with the traceback', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const msg = await r.run(r.name, { code: 'print("start")\nawait fail(reason="uncaught")\nprint("never")' });
  assert.equal(msg.status, 'error', contentText(msg));
  const text = contentText(msg);
  assert.match(text, /Programmatic execution failed: Code execution failed\. Execution exited with code 1/);
  assert.match(text, /Stderr:\n[\s\S]*disk on fire \(uncaught\)/);
  assert.doesNotMatch(text, /never/);
  const last = ptcRequests(proxy, mark).at(-1);
  assert.equal(last.response.status, 'error');
  assert.equal(last.response.error, 'Sandbox exited with code 1');
  assert.match(last.response.stdout, /^start\n/);
});

test('3.9.x Python: calling a tool the run was not given fails clearly', async (t) => {
  await t.test('not in the tool_manifest: the function does not exist in the sandbox (NameError)', async () => {
    const mark = proxy.log.length;
    const r = ptcRunner(lc, currentPtc());
    const msg = await r.run(r.name, { code: 'x = await add(a=1, b=2)\nprint(await mul(a=x, b=2))', tool_manifest: ['add'] });
    assert.equal(msg.status, 'error', contentText(msg));
    assert.match(contentText(msg), /NameError: name 'mul' is not defined/);
    const ex = ptcRequests(proxy, mark);
    assert.deepEqual(ex[0].body.tools.map((d) => d.name), ['add']);
    assert.deepEqual(batches(ex).flat().map((c) => c.name), ['add']);
  });
  await t.test('defined but missing from the toolMap: the client answers is_error and the code gets the message', async () => {
    // The package's own tests invoke the tool this way (config.toolCall carrying toolMap and toolDefs).
    const mark = proxy.log.length;
    const host = hostTools(lc);
    const ptc = currentPtc();
    const args = {
      code: 'try:\n    await mul(a=2, b=2)\nexcept Exception as e:\n    print("caught:", e)',
    };
    const toolCall = {
      name: ptc.name,
      args,
      toolMap: new Map(host.list.filter((x) => x.name === 'add').map((x) => [x.name, x])),
      toolDefs: [...host.toolRegistry.values()].filter((d) => d.name === 'add' || d.name === 'mul'),
    };
    const out = await ptc.invoke(args, { toolCall });
    assert.match(out, /^stdout:\ncaught: Tool 'mul' not found\. Available tools: add$/);
    const ex = ptcRequests(proxy, mark);
    assert.equal(ex[1].body.tool_results[0].is_error, true);
  });
});

test('3.9.x Python: 20 round trips (the client\'s maximum) in one run', async (t) => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const code = 'total = 0\nfor i in range(20):\n    total = await add(a=total, b=i)\nprint("total", total)';
  const started = performance.now();
  const msg = await r.run(r.name, { code });
  const elapsed = performance.now() - started;
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\ntotal 190');
  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  assert.equal(ex.length, 21);
  assert.deepEqual(batches(ex).map((b) => b.length), Array(20).fill(1));
  assert.deepEqual(batches(ex).map((b) => b[0].input.b), [...Array(20).keys()]);
  t.diagnostic(`20 round trips in ${Math.round(elapsed)} ms (each tool call sleeps 50 ms on the client)`);
});

test('3.9.x Python: a tool slower than the run\'s timeout ends the run with the time limit', async () => {
  // The client's minimum timeout is 1000 ms. The broker counts the wait for the client's
  // results in the run's wall time (LibreChat's own Code API replays the code per round
  // trip instead, and caps each replay: "timeout caps one sandbox run/replay iteration").
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const started = performance.now();
  const msg = await r.run(r.name, { code: 'print("start")\nprint(await slow(ms=2500))', timeout: 1000 });
  const elapsed = performance.now() - started;
  assert.equal(msg.status, 'error', contentText(msg));
  assert.match(contentText(msg), /Programmatic execution failed: Code execution failed\. Execution exceeded the time limit\./);
  const ex = ptcRequests(proxy, mark);
  assert.equal(ex[0].body.timeout, 1000);
  assert.equal(ex.at(-1).response.status, 'error');
  assert.equal(ex.at(-1).response.error, 'Time limit exceeded');
  assert.ok(elapsed >= 2500 && elapsed < 10_000, `ended after ${Math.round(elapsed)} ms`);
});

test('3.9.x Python: code that runs past its timeout before calling any tool', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const started = performance.now();
  const msg = await r.run(r.name, { code: 'import time\ntime.sleep(10)\nprint(await add(a=1, b=1))', timeout: 1000 });
  const elapsed = performance.now() - started;
  assert.equal(msg.status, 'error', contentText(msg));
  assert.match(contentText(msg), /Execution exceeded the time limit\./);
  assert.equal(ptcRequests(proxy, mark).length, 1);
  assert.ok(elapsed < 6000, `ended after ${Math.round(elapsed)} ms`);
  assert.equal(r.calls.length, 0);
});

/** Python that appends a dot to /mnt/data/ticks.txt every 100 ms for 20 s, then calls add. */
const TICKING = [
  'import time',
  'for _ in range(200):',
  "    with open('/mnt/data/ticks.txt', 'a') as f:",
  "        f.write('.')",
  '    time.sleep(0.1)',
  'print(await add(a=1, b=1))',
].join('\n');

/** Whether the ticking run of session `s` has stopped: an exec in that session gets its turn and sees no new ticks. */
async function assertTicksStopped(s, headers) {
  const started = performance.now();
  const r = await call(`${broker.v1}/exec`, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...headers },
    body: JSON.stringify({
      lang: 'py',
      session_id: s,
      code: "import os, time\nn = lambda: os.path.getsize('/mnt/data/ticks.txt')\na = n()\ntime.sleep(1)\nprint(a, n())",
    }),
  });
  const waited = performance.now() - started;
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.session_id, s);
  const [a, b] = r.json.stdout.trim().split(' ').map(Number);
  assert.ok(a > 0 && a === b, `ticks stopped: ${r.json.stdout} ${r.json.stderr}`);
  assert.ok(waited < 10_000, `the session was free (the exec took ${Math.round(waited)} ms)`);
}

async function waitFor(pred, what, ms = 8000) {
  const deadline = Date.now() + ms;
  for (;;) {
    const v = pred();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await sleep(50);
  }
}

test('3.9.x Python: aborting the run (LibreChat stops the agent) cancels it through POST /exec/programmatic/cancel', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const controller = new AbortController();
  const pending = r.run(r.name, { code: TICKING }, { signal: controller.signal }).then(
    (m) => ({ message: m }),
    (e) => ({ error: e }),
  );
  await sleep(2000);
  controller.abort();
  const outcome = await pending;
  if (outcome.message) assert.equal(outcome.message.status, 'error', contentText(outcome.message));

  const first = ptcRequests(proxy, mark)[0];
  const requestId = first.headers['x-librechat-code-request-id'];
  assert.match(requestId, /^[0-9a-f-]{36}$/, 'with a signal the client names its request');
  const cancel = await waitFor(
    () => proxy.since(mark).find((e) => e.url === `${PTC_PATH}/cancel` && e.status !== undefined),
    'the cancel request',
  );
  assert.equal(cancel.method, 'POST');
  assert.deepEqual(cancel.body, { request_id: requestId });
  assert.match(cancel.headers.authorization, /^Bearer /);
  assert.equal(cancel.status, 200, JSON.stringify(cancel.response));
  assert.equal(cancel.response.request_id, requestId);
  assert.match(cancel.response.session_id, ID_RE);
  assert.equal(r.calls.length, 0, 'the run never reached its tool call');
  await assertTicksStopped(cancel.response.session_id, { Authorization: `Bearer ${broker.mintJwt(USER)}` });
});

test('3.9.x Python: aborting during a continuation stops the run too', async (t) => {
  // The client makes a new request id for every request, continuations included, and
  // cancels with the id of the request in flight.
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const controller = new AbortController();
  const code = `print(await add(a=1, b=2))\n${TICKING}`;
  const pending = r.run(r.name, { code }, { signal: controller.signal }).then(
    (m) => ({ message: m }),
    (e) => ({ error: e }),
  );
  await waitFor(() => ptcRequests(proxy, mark).length >= 2, 'the continuation');
  await sleep(1500);
  controller.abort();
  await pending;
  const ex = ptcRequests(proxy, mark);
  const cont = ex[1];
  assert.ok(cont.body.continuation_token);
  const contId = cont.headers['x-librechat-code-request-id'];
  assert.match(contId, /^[0-9a-f-]{36}$/);
  assert.notEqual(contId, ex[0].headers['x-librechat-code-request-id']);
  const cancel = await waitFor(
    () => proxy.since(mark).find((e) => e.url === `${PTC_PATH}/cancel` && e.status !== undefined),
    'the cancel request',
  );
  assert.deepEqual(cancel.body, { request_id: contId });
  t.diagnostic(`cancel naming the continuation's request id: HTTP ${cancel.status} ${JSON.stringify(cancel.response)}`);
  await assertTicksStopped(ex[0].response.session_id, { Authorization: `Bearer ${broker.mintJwt(USER)}` });
});

test('3.9.x Python: two runs through one ToolNode share the code session (session_id and file refs go back)', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentPtc());
  const first = await r.run(r.name, {
    code: "import json\nw = await weather(city='Oslo')\njson.dump(w, open('/mnt/data/oslo.json', 'w'))\nprint('saved')",
  });
  assert.equal(first.status, 'success', contentText(first));
  assert.deepEqual(first.artifact.files.map((f) => f.name), ['oslo.json']);
  const second = await r.run(r.name, {
    code: "import json\nw = json.load(open('/mnt/data/oslo.json'))\nprint(w['temp_c'] + await add(a=0, b=1))",
  });
  assert.equal(second.status, 'success', contentText(second));
  assert.match(contentText(second), /^stdout:\n5$/);
  const firsts = ptcRequests(proxy, mark).filter((e) => e.body.code !== undefined);
  assert.equal(firsts.length, 2);
  assert.equal(firsts[1].body.session_id, first.artifact.session_id);
  assert.deepEqual(firsts[1].body.files.map((f) => f.name), ['oslo.json']);
  assert.equal(second.artifact.session_id, first.artifact.session_id);
});

test('3.9.x bash (what LibreChat creates today): tool functions take JSON, print results; `: &\\nwait "$!"` in front', async () => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentBashPtc());
  const code = [
    `s=$(add '{"a": 2, "b": 3}')`,
    `p=$(mul "{\\"a\\": $s, \\"b\\": 4}")`,
    `w=$(weather '{"city": "Cairo"}')`,
    'echo "sum $s product $p weather $w"',
  ].join('\n');
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\nsum 5 product 20 weather {"city":"Cairo","temp_c":27}');
  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  assert.equal(ex[0].body.lang, 'bash');
  assert.equal(ex[0].body.code, `: &\nwait "$!"\n${code}`);
  assert.match(ex[0].headers.authorization, /^Bearer /);
  assert.deepEqual(batches(ex).flat().map((c) => [c.name, c.input]), [
    ['add', { a: 2, b: 3 }],
    ['mul', { a: 5, b: 4 }],
    ['weather', { city: 'Cairo' }],
  ]);
});

test('3.9.x bash: the description\'s parallel example (& and wait), and a failing tool', async (t) => {
  const mark = proxy.log.length;
  const r = ptcRunner(lc, currentBashPtc());
  const code = [
    `{ a=$(add '{"a": 1, "b": 2}'); printf '%s\\n' "$a" > /mnt/data/a.json; } &`,
    `{ m=$(mul '{"a": 3, "b": 4}'); printf '%s\\n' "$m" > /mnt/data/m.json; } &`,
    'wait',
    'echo "add $(cat /mnt/data/a.json) mul $(cat /mnt/data/m.json)"',
    `if out=$(fail '{"reason": "bash"}' 2>/tmp/err); then echo "no error?"; else echo "failed: $(cat /tmp/err)"; fi`,
  ].join('\n');
  const msg = await r.run(r.name, { code });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout:\nadd 3 mul 12\nfailed: .*disk on fire \(bash\)/);
  const b = batches(ptcRequests(proxy, mark));
  assert.deepEqual(b.flat().map((c) => c.name).sort(), ['add', 'fail', 'mul']);
  t.diagnostic(`bash: & and wait gave ${b.length} round trips (${b.map((x) => x.length).join('+')})`);
});

// ---------------------------------------------------------------------------------------
// @librechat/agents 3.1.77 (the 0.8.5 era): no credentials at all
// ---------------------------------------------------------------------------------------

describe('3.1.77 (a broker with CODEBROKER_AUTH=none: this client sends no key)', () => {
  let open; // broker without auth
  let openProxy;
  let g;

  before(async () => {
    // makeRequest of 3.1.77 (src/tools/ProgrammaticToolCalling.ts) sends only Content-Type
    // and User-Agent; the factory ignores any key it is given. Against a broker that
    // requires auth it gets 401 on its first request, whatever LibreChat configured, so
    // this generation's programmatic tools need CODEBROKER_AUTH=none.
    open = await startBroker({ auth: 'none' });
    openProxy = await recordingProxy(open.root);
    g = await loadAgents('librechat-agents-085');
  });

  after(async () => {
    await openProxy?.close();
    await open?.stop();
  });

  const ptc = () => g.agents.createProgrammaticToolCallingTool({ baseUrl: `${openProxy.url}/v1` });
  const bashPtc = () => g.agents.createBashProgrammaticToolCallingTool({ baseUrl: `${openProxy.url}/v1` });

  test('3.1.77: no credentials are sent; against a broker that requires them the run is refused', async () => {
    assert.match(g.version, /^3\.1\./);
    const host = hostTools(g);
    const tool = g.agents.createProgrammaticToolCallingTool({ baseUrl: `${proxy.url}/v1`, apiKey: broker.apiKey });
    const mark = proxy.log.length;
    const runner = toolRunner(g, [tool, ...host.list], new Map(), { toolRegistry: host.toolRegistry });
    const msg = await runner.run(tool.name, { code: 'print(await add(a=1, b=1))' });
    assert.equal(msg.status, 'error');
    assert.match(contentText(msg), /HTTP error! status: 401/);
    const [req] = ptcRequests(proxy, mark);
    assert.equal(req.headers.authorization, undefined);
    assert.equal(req.headers['x-api-key'], undefined);
    assert.equal(req.body.LIBRECHAT_CODE_API_KEY, undefined);
  });

  test('3.1.77 Python: sequential and parallel calls, tools filtered to those the code names, timeout 60000', async () => {
    const mark = openProxy.log.length;
    const r = ptcRunner(g, ptc());
    const code = [
      'import asyncio',
      's = await add(a=2, b=3)',
      'p, w = await asyncio.gather(mul(a=s, b=4), weather(city="Oslo"))',
      'print(s, p, w)',
    ].join('\n');
    const msg = await r.run(r.name, { code });
    assert.equal(msg.status, 'success', contentText(msg));
    assert.match(contentText(msg), /^stdout:\n5 20 \{'city': 'Oslo', 'temp_c': 4\}$/);
    const ex = ptcRequests(openProxy, mark);
    assertChain(ex);
    assert.deepEqual(Object.keys(ex[0].body).sort(), ['code', 'timeout', 'tools']);
    assert.equal(ex[0].body.timeout, 60000);
    assert.deepEqual(ex[0].body.tools.map((t) => t.name), ['add', 'mul', 'weather']);
    assert.deepEqual(batches(ex).map((b) => b.map((c) => c.name).sort()), [['add'], ['mul', 'weather']]);
    for (const e of ex) {
      assert.equal(e.headers.authorization, undefined);
      assert.equal(e.headers['x-api-key'], undefined);
    }
  });

  test('3.1.77 Python: a throwing tool is caught; an uncaught one is "Execution error: Sandbox exited with code 1"', async () => {
    const r = ptcRunner(g, ptc());
    const ok = await r.run(r.name, {
      code: 'try:\n    await fail(reason="085")\nexcept Exception as e:\n    print("caught", e)',
    });
    assert.equal(ok.status, 'success', contentText(ok));
    assert.match(contentText(ok), /^stdout:\ncaught disk on fire \(085\)$/);
    const bad = await r.run(r.name, { code: 'await fail(reason="085 uncaught")' });
    assert.equal(bad.status, 'error');
    assert.match(contentText(bad), /Programmatic execution failed: Execution error: Sandbox exited with code 1\n\nStderr:\n[\s\S]*disk on fire \(085 uncaught\)/);
  });

  test('3.1.77 bash: lang bash, the code as written', async () => {
    const mark = openProxy.log.length;
    const r = ptcRunner(g, bashPtc());
    const code = `s=$(add '{"a": 20, "b": 22}')\necho "answer $s"`;
    const msg = await r.run(r.name, { code });
    assert.equal(msg.status, 'success', contentText(msg));
    assert.match(contentText(msg), /^stdout:\nanswer 42$/);
    const ex = ptcRequests(openProxy, mark);
    assert.equal(ex[0].body.lang, 'bash');
    assert.equal(ex[0].body.code, code);
  });
});

// ---------------------------------------------------------------------------------------
// @librechat/agents 3.0.50 (classic): X-API-Key
// ---------------------------------------------------------------------------------------

test('3.0.50 Python: X-API-Key on every request; sequential, parallel and a caught tool error', async () => {
  assert.match(classic.version, /^3\.0\./);
  const mark = proxy.log.length;
  const tool = classic.agents.createProgrammaticToolCallingTool({ apiKey: broker.apiKey, baseUrl: `${proxy.url}/v1` });
  // 3.0.50 exports no ToolNode: the tool is invoked as its ToolNode does it, the tool call
  // carrying the injected toolMap and toolDefs (src/tools/ToolNode.ts runTool).
  const host = hostTools(classic);
  const toolDefs = [...host.toolRegistry.values()];
  const toolMap = new Map(host.list.map((x) => [x.name, x]));
  const code = [
    'import asyncio',
    's = await add(a=2, b=3)',
    'p, q = await asyncio.gather(mul(a=s, b=4), mul(a=s, b=5))',
    'try:',
    '    await fail(reason="classic")',
    'except Exception as e:',
    '    print("caught", e)',
    'print(s, p, q)',
  ].join('\n');
  const msg = await tool.invoke({ id: 'call_classic_1', name: tool.name, args: { code }, type: 'tool_call', toolMap, toolDefs });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout:\ncaught disk on fire \(classic\)\n5 20 25$/);
  const ex = ptcRequests(proxy, mark);
  assertChain(ex);
  for (const e of ex) assert.equal(e.headers['x-api-key'], broker.apiKey);
  assert.deepEqual(batches(ex).map((b) => b.length), [1, 2, 1]);
});

// ---------------------------------------------------------------------------------------
// Plain HTTP: what the packages do not send
// ---------------------------------------------------------------------------------------

const keyJson = (extra = {}) => ({ 'Content-Type': 'application/json', 'X-API-Key': broker.apiKey, ...extra });

function post(body, headers = {}) {
  return call(`${broker.v1}/exec/programmatic`, { method: 'POST', headers: keyJson(headers), body: JSON.stringify(body) });
}

const specs = (...names) => names.map((name) => ({ name, ...TOOL_DEFS[name] }));

/** What the host answers for a call, as a client would compute it. */
function answer(c) {
  const { a, b } = c.input;
  switch (c.name) {
    case 'add':
      return { call_id: c.id, result: a + b, is_error: false };
    case 'mul':
      return { call_id: c.id, result: a * b, is_error: false };
    case 'fail':
      return { call_id: c.id, result: null, is_error: true, error_message: `disk on fire (${c.input.reason})` };
    default:
      return { call_id: c.id, result: null, is_error: true, error_message: `no such tool ${c.name}` };
  }
}

/** Runs one programmatic request to its end, answering every batch with `answer`. */
async function drive(body, headers = {}) {
  const seen = [];
  let r = await post(body, headers);
  assert.equal(r.status, 200, show(r));
  while (r.json.status === 'tool_call_required') {
    seen.push(r.json.tool_calls);
    r = await post({ continuation_token: r.json.continuation_token, tool_results: r.json.tool_calls.map(answer) });
    assert.equal(r.status, 200, show(r));
  }
  return { final: r.json, batches: seen };
}

test('HTTP JavaScript: `await name({...})`, Promise.all in one batch, ToolError caught', async () => {
  const code = [
    'const [s, p] = await Promise.all([add({ a: 1, b: 2 }), mul({ a: 3, b: 4 })]);',
    'let caught = "none";',
    'try { await fail({ reason: "js" }); } catch (e) { caught = `${e.name}: ${e.message}`; }',
    'console.log(s, p, caught);',
  ].join('\n');
  const { final, batches: b } = await drive({ lang: 'js', code, tools: specs('add', 'mul', 'fail') });
  assert.equal(final.status, 'completed', JSON.stringify(final));
  assert.equal(final.stdout, '3 12 ToolError: disk on fire (js)\n');
  assert.deepEqual(b.map((x) => x.map((c) => c.name).sort()), [['add', 'mul'], ['fail']]);
});

test('HTTP bash: `name JSON` commands, sequential', async () => {
  const code = `s=$(add '{"a": 2, "b": 3}')\np=$(mul "{\\"a\\": $s, \\"b\\": 4}")\necho "$s $p"`;
  const { final, batches: b } = await drive({ lang: 'bash', code, tools: specs('add', 'mul') });
  assert.equal(final.status, 'completed', JSON.stringify(final));
  assert.equal(final.stdout, '5 20\n');
  assert.deepEqual(b.map((x) => x.map((c) => [c.name, c.input])), [[['add', { a: 2, b: 3 }]], [['mul', { a: 5, b: 4 }]]]);
});

test('HTTP: a tool the request did not declare is not defined in Python (NameError) nor in JavaScript (ReferenceError)', async () => {
  const py = await drive({ code: 'x = await add(a=1, b=2)\nprint(await mul(a=x, b=2))', tools: specs('add') });
  assert.equal(py.final.status, 'error', JSON.stringify(py.final));
  assert.match(py.final.stderr, /NameError: name 'mul' is not defined/);
  assert.equal(py.batches.length, 1);
  const js = await drive({ lang: 'js', code: 'await mul({ a: 1, b: 2 });', tools: specs('add') });
  assert.equal(js.final.status, 'error', JSON.stringify(js.final));
  assert.match(js.final.stderr, /ReferenceError: mul is not defined/);
});

test('HTTP: a client slower than the timeout gets status error "Time limit exceeded" when it comes back', async () => {
  // The timeout leaves room for a new sandbox's first Python exec under gVisor, which
  // passed 1.5 s on a loaded host before the code reached its tool call.
  const first = await post({ code: 'print(await add(a=1, b=1))', tools: specs('add'), timeout: 4000 });
  assert.equal(first.json.status, 'tool_call_required', show(first));
  await sleep(6000);
  const r = await post({ continuation_token: first.json.continuation_token, tool_results: first.json.tool_calls.map(answer) });
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.status, 'error', show(r));
  assert.equal(r.json.error, 'Time limit exceeded');
});

test('HTTP cancel: a run in flight, named by X-LibreChat-Code-Request-ID, ends with status error', async () => {
  const requestId = `req-${Date.now()}`;
  const started = performance.now();
  const running = post({ code: 'import time\ntime.sleep(20)\nprint(await add(a=1, b=2))', tools: specs('add') }, {
    'X-LibreChat-Code-Request-ID': requestId,
  });
  await sleep(1500);
  const c = await call(`${broker.v1}/exec/programmatic/cancel`, {
    method: 'POST',
    headers: keyJson(),
    body: JSON.stringify({ request_id: requestId }),
  });
  assert.equal(c.status, 200, show(c));
  assert.equal(c.json.request_id, requestId);
  const r = await running;
  const elapsed = performance.now() - started;
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.status, 'error', show(r));
  assert.equal(typeof r.json.error, 'string');
  assert.equal(r.json.session_id, c.json.session_id);
  assert.ok(elapsed < 10_000, `the run ended ${Math.round(elapsed)} ms after it started`);
  // Once over, the id is forgotten.
  const again = await call(`${broker.v1}/exec/programmatic/cancel`, {
    method: 'POST',
    headers: keyJson(),
    body: JSON.stringify({ request_id: requestId }),
  });
  assert.equal(again.status, 404, show(again));
});

test('HTTP cancel: a run waiting for tool results; its token then leads to status error, and is single use', async () => {
  const requestId = `req-${Date.now()}-parked`;
  const first = await post({ code: 'x = await add(a=1, b=2)\nprint("never", x)', tools: specs('add') }, {
    'X-LibreChat-Code-Request-ID': requestId,
  });
  assert.equal(first.json.status, 'tool_call_required', show(first));
  const c = await call(`${broker.v1}/exec/programmatic/cancel`, {
    method: 'POST',
    headers: keyJson(),
    body: JSON.stringify({ request_id: requestId }),
  });
  assert.equal(c.status, 200, show(c));
  const cont = { continuation_token: first.json.continuation_token, tool_results: first.json.tool_calls.map(answer) };
  const r = await post(cont);
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.status, 'error', show(r));
  assert.doesNotMatch(r.json.stdout ?? '', /never/);
  const replay = await post(cont);
  assert.equal(replay.status, 409, show(replay));
  const unknown = await call(`${broker.v1}/exec/programmatic/cancel`, {
    method: 'POST',
    headers: keyJson(),
    body: JSON.stringify({ request_id: 'no-such-request' }),
  });
  assert.equal(unknown.status, 404, show(unknown));
});

// LibreChat v0.8.5+ against codebroker, through the real client: @librechat/agents 3.9.x
// (LibreChat's current execute_code / bash_tool), run by its own ToolNode the way
// LibreChat's agent graph runs it.
//
// How LibreChat builds the tool (api/app/clients/tools/util/handleTools.js):
//   createCodeExecutionTool({ user_id, files, authHeaders: () => getCodeApiAuthHeaders(req), ...codeExecutionContext })
// where getCodeApiAuthHeaders mints `Authorization: Bearer <EdDSA JWT>` (sub = user id).
// The base URL comes from LIBRECHAT_CODE_BASEURL (src/tools/CodeExecutor.ts getCodeBaseURL).
// Between calls, ToolNode keeps the code session in its `sessions` map and passes the earlier
// outputs back as `files` refs {id, resource_id, name, storage_session_id, kind} — never a
// session_id in the body (src/tools/ToolNode.ts toInjectedFileRef, CodeExecutor.ts postData).

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startBroker } from '../lib/broker.mjs';
import { recordingProxy, call, show, download, form, sha256, ID_RE, PY_HASHES, parseHashes } from '../lib/http.mjs';
import { loadAgents, toolRunner, contentText } from '../lib/agents.mjs';

const USER = '665f1c2e9b1e8a0012345601';
let broker;
let proxy;
let lc;

before(async () => {
  broker = await startBroker({ jwt: true });
  proxy = await recordingProxy(broker.root);
  process.env.LIBRECHAT_CODE_BASEURL = `${proxy.url}/v1`;
  lc = await loadAgents('@librechat/agents');
});

after(async () => {
  await proxy?.close();
  await broker?.stop();
});

/** The tool as LibreChat's handleTools.js builds it for one user. */
function codeTool({ files, user = USER, token } = {}) {
  return lc.agents.createCodeExecutionTool({
    user_id: user,
    ...(files ? { files } : {}),
    authHeaders: () => ({ Authorization: `Bearer ${token ?? broker.mintJwt(user)}` }),
  });
}

function execRequests(mark) {
  return proxy.since(mark).filter((e) => e.method === 'POST' && e.url === '/v1/exec');
}

test('the package reads LIBRECHAT_CODE_BASEURL and exports createCodeExecutionTool', () => {
  assert.match(lc.version, /^3\.9\./);
  assert.equal(lc.agents.EnvVar.CODE_BASEURL, 'LIBRECHAT_CODE_BASEURL');
  assert.equal(lc.agents.getCodeBaseURL(), `${proxy.url}/v1`);
  assert.equal(typeof lc.agents.createCodeExecutionTool, 'function');
});

test('execute_code: stdout comes back as the tool formats it', async () => {
  const mark = proxy.log.length;
  const runner = toolRunner(lc, [codeTool()]);
  const msg = await runner.run('execute_code', { lang: 'py', code: 'print(6 * 7)' });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\n42');
  assert.match(msg.artifact.session_id, ID_RE);
  assert.equal(msg.artifact.files, undefined);

  const [req] = execRequests(mark);
  assert.ok(req, 'the client sent POST /v1/exec');
  assert.match(req.headers.authorization, /^Bearer [\w-]+\.[\w-]+\.[\w-]+$/);
  assert.equal(req.headers['user-agent'], 'LibreChat/1.0');
  assert.deepEqual(req.body, { lang: 'py', code: 'print(6 * 7)', user_id: USER });
  assert.equal(req.status, 200);
});

test('execute_code: an exception lands in stderr, the call itself succeeds', async () => {
  const runner = toolRunner(lc, [codeTool()]);
  const msg = await runner.run('execute_code', {
    lang: 'py',
    code: 'print("before")\nraise ValueError("boom from the sandbox")',
  });
  assert.equal(msg.status, 'success', contentText(msg));
  const text = contentText(msg);
  assert.match(text, /^stdout:\nbefore\n/);
  assert.match(text, /\nstderr:\n[\s\S]*ValueError: boom from the sandbox/);
});

test('execute_code: plt.show() PNG and a pandas CSV come back as files, download byte for byte, and the next call finds the session', async () => {
  const mark = proxy.log.length;
  const runner = toolRunner(lc, [codeTool()]);
  const code = `${PY_HASHES}
import os
import pandas as pd
import matplotlib.pyplot as plt
secret = 'kept-between-calls'
df = pd.DataFrame({'x': [1, 2, 3, 4], 'y': [1, 4, 9, 16]})
df.to_csv('/mnt/data/squares.csv', index=False)
plt.plot(df.x, df.y)
plt.title('squares')
plt.show()
print('rows', len(df))
_hashes('squares.csv')
`;
  const first = await runner.run('execute_code', { lang: 'py', code });
  assert.equal(first.status, 'success', contentText(first));
  const text = contentText(first);
  assert.match(text, /^stdout:\nrows 4\n/);
  // The summary the package appends for the model (src/tools/CodeSessionFileSummary.ts).
  assert.match(text, /Generated files:\nSession files: 2 persisted file\(s\) are available in \/mnt\/data, including 1 image\(s\)\./);

  const art = first.artifact;
  assert.match(art.session_id, ID_RE);
  const names = art.files.map((f) => f.name).sort();
  assert.equal(names.length, 2, JSON.stringify(art.files));
  assert.equal(names[1], 'squares.csv');
  assert.match(names[0], /\.png$/);
  for (const f of art.files) {
    assert.match(f.id, ID_RE);
    assert.notEqual(f.inherited, true);
  }

  // What LibreChat then fetches: /download/{artifact.session_id}/{file.id}, with its token.
  const auth = { Authorization: `Bearer ${broker.mintJwt(USER)}` };
  const csv = art.files.find((f) => f.name === 'squares.csv');
  const png = art.files.find((f) => f.name.endsWith('.png'));
  const hashes = parseHashes(text);
  const csvDl = await download(broker.v1, art.session_id, csv.id, auth);
  assert.equal(csvDl.bytes.length, hashes['squares.csv'][0]);
  assert.equal(sha256(csvDl.bytes), hashes['squares.csv'][1]);
  assert.equal(csvDl.bytes.toString(), 'x,y\n1,1\n2,4\n3,9\n4,16\n');
  const pngDl = await download(broker.v1, art.session_id, png.id, auth);
  assert.deepEqual([...pngDl.bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]);
  assert.match(pngDl.headers.get('content-type'), /^image\/png/);
  assert.match(pngDl.headers.get('content-disposition'), new RegExp(png.name.replace('.', '\\.')));

  // Second call through the same ToolNode: the package sends the earlier outputs as refs.
  const second = await runner.run('execute_code', {
    lang: 'py',
    code: "import os\nprint(sorted(n for n in os.listdir('/mnt/data') if not n.startswith('.')))\nprint(open('/mnt/data/squares.csv').read().splitlines()[-1])\nprint(globals().get('secret', 'state-lost'))",
  });
  assert.equal(second.status, 'success', contentText(second));
  const execs = execRequests(mark);
  assert.equal(execs.length, 2);
  const sent = execs[1].body;
  assert.equal(sent.session_id, undefined, 'the client sends no session_id');
  assert.deepEqual(
    sent.files.map((f) => Object.keys(f).sort().join(',')),
    sent.files.map(() => 'id,kind,name,resource_id,storage_session_id'),
  );
  assert.deepEqual(sent.files.map((f) => f.name).sort(), names);
  for (const f of sent.files) {
    assert.equal(f.kind, 'user');
    assert.equal(f.storage_session_id, art.files.find((g) => g.id === f.id).storage_session_id ?? art.session_id);
  }

  const out = contentText(second);
  assert.match(out, new RegExp(`'${png.name.replace('.', '\\.')}'`));
  assert.match(out, /'squares\.csv'/);
  assert.match(out, /\n4,16\n/);
  assert.equal(second.artifact.session_id, art.session_id, 'the refs led the broker back to the first session');
  assert.match(out, /kept-between-calls/, `a global set in call 1 is visible in call 2: ${out}`);
  assert.equal(second.artifact.runtime_status, 'reused');
});

test('execute_code: a CSV the host uploaded (v0.8.5+ upload, primed as a files ref) is read by pandas', async () => {
  const auth = { Authorization: `Bearer ${broker.mintJwt(USER)}` };
  const data = 'city,temp\nOslo,4\nRome,18\nCairo,27\n';
  const up = await call(`${broker.v1}/upload`, {
    method: 'POST',
    headers: { ...auth, 'User-Agent': 'LibreChat/1.0' },
    body: form({ kind: 'user', id: USER }, [{ name: 'weather.csv', data, type: 'text/csv' }]),
  });
  assert.equal(up.status, 200, show(up));
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const ref = { id: F, resource_id: USER, storage_session_id: S, name: 'weather.csv', kind: 'user' };
  const runner = toolRunner(lc, [codeTool({ files: [ref] })]);
  const msg = await runner.run('execute_code', {
    lang: 'py',
    code: "import pandas as pd\ndf = pd.read_csv('/mnt/data/weather.csv')\nprint(df.temp.mean())\ndf.sort_values('temp').to_csv('/mnt/data/sorted.csv', index=False)",
  });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout:\n16\.333/);
  const outs = (msg.artifact.files ?? []).filter((f) => f.inherited !== true).map((f) => f.name);
  assert.deepEqual(outs, ['sorted.csv']);
  const sorted = msg.artifact.files.find((f) => f.name === 'sorted.csv');
  const dl = await download(broker.v1, msg.artifact.session_id, sorted.id, auth);
  assert.equal(dl.text, 'city,temp\nOslo,4\nRome,18\nCairo,27\n');
});

test('execute_code: an input the code removes comes back as deleted_files, and ToolNode stops sending it', async () => {
  const mark = proxy.log.length;
  const runner = toolRunner(lc, [codeTool()]);
  const made = await runner.run('execute_code', {
    lang: 'py',
    code: "open('/mnt/data/input.txt', 'w').write('draft')\nopen('/mnt/data/notes.txt', 'w').write('keep')",
  });
  assert.equal(made.status, 'success', contentText(made));
  assert.deepEqual(made.artifact.files.map((f) => f.name).sort(), ['input.txt', 'notes.txt']);

  // ToolNode injects both as refs; the code removes one.
  const removed = await runner.run('execute_code', {
    lang: 'py',
    code: "import os\nos.remove('/mnt/data/input.txt')\nprint(sorted(os.listdir('/mnt/data')))",
  });
  assert.equal(removed.status, 'success', contentText(removed));
  assert.match(contentText(removed), /\['notes\.txt'\]/);
  assert.deepEqual(removed.artifact.deleted_files, ['input.txt']);
  const execs = execRequests(mark);
  assert.deepEqual(execs[1].body.files.map((f) => f.name).sort(), ['input.txt', 'notes.txt']);
  assert.deepEqual(execs[1].response.deleted_files, ['input.txt']);

  // The client read it: its session no longer holds input.txt, so the next call sends only notes.txt.
  const next = await runner.run('execute_code', { lang: 'py', code: "print(open('/mnt/data/notes.txt').read())" });
  assert.equal(contentText(next), 'stdout:\nkeep');
  const third = execRequests(mark)[2].body;
  assert.deepEqual(third.files.map((f) => f.name), ['notes.txt']);
  assert.equal(next.artifact.deleted_files, undefined);
});

test('execute_code: generated files the broker could not keep bring the client\'s artifact delivery warning', async () => {
  const runner = toolRunner(lc, [codeTool()]);
  // 11 MiB is over CODEBROKER_MAX_OUTPUT_FILE_MB (10).
  const partial = await runner.run('execute_code', {
    lang: 'py',
    code: "open('/mnt/data/big.bin', 'wb').write(bytes(11 * 1024 * 1024))\nopen('/mnt/data/small.txt', 'w').write('ok')\nprint('wrote')",
  });
  assert.equal(partial.status, 'success', contentText(partial));
  const text = contentText(partial);
  assert.ok(
    text.includes(
      'Artifact delivery warning: 1 of 2 generated files could not be persisted. Do not assume missing files are available to later calls or downloadable. The code itself ran; do not rerun automatically because it may have had side effects.',
    ),
    text,
  );
  // The broker's own note says which file and why.
  assert.match(text, /stderr:\n[\s\S]*big\.bin/);
  assert.deepEqual(partial.artifact.artifact_delivery, {
    code: 'artifact_delivery_failed',
    status: 'partial',
    attempted: 2,
    delivered: 1,
    failed: 1,
  });
  assert.deepEqual(partial.artifact.files.map((f) => f.name), ['small.txt']);

  // None kept at all: status "failed", and the warning says 1 of 1.
  const failed = await runner.run('execute_code', {
    lang: 'py',
    code: "open('/mnt/data/huge.bin', 'wb').write(bytes(11 * 1024 * 1024))",
  });
  assert.equal(failed.status, 'success', contentText(failed));
  assert.match(contentText(failed), /Artifact delivery warning: 1 of 1 generated files could not be persisted\./);
  assert.equal(failed.artifact.artifact_delivery.status, 'failed');
  assert.equal(failed.artifact.artifact_delivery.delivered, 0);
});

test('execute_code with stateful sessions: runtime_session_hint keeps the session even when no file links the calls', async () => {
  // LibreChat's codeExecutionContext for an agent with statefulCodeSessions:
  // { statefulSessions: true, executionProfile: 'stateful', runtimeSessionHint }.
  const mark = proxy.log.length;
  const hint = `conv-${Date.now()}`;
  const tool = lc.agents.createCodeExecutionTool({
    user_id: USER,
    authHeaders: () => ({ Authorization: `Bearer ${broker.mintJwt(USER)}` }),
    statefulSessions: true,
    executionProfile: 'stateful',
    runtimeSessionHint: hint,
  });
  const runner = toolRunner(lc, [tool]);
  const first = await runner.run('execute_code', { lang: 'py', code: 'counter = 41\nprint("set")' });
  assert.equal(first.status, 'success', contentText(first));
  const second = await runner.run('execute_code', { lang: 'py', code: 'counter += 1\nprint(counter)' });
  assert.equal(second.status, 'success', contentText(second));
  const execs = execRequests(mark);
  assert.equal(execs[0].body.runtime_session_hint, hint);
  assert.equal(execs[0].headers['x-codeapi-expected-profile'], 'stateful');
  assert.equal(second.artifact.session_id, first.artifact.session_id);
  assert.equal(contentText(second), 'stdout:\n42');
});

test('bash_tool: a command runs through /exec as lang bash', async () => {
  const mark = proxy.log.length;
  const tool = lc.agents.createBashExecutionTool({
    user_id: USER,
    authHeaders: () => ({ Authorization: `Bearer ${broker.mintJwt(USER)}` }),
  });
  const runner = toolRunner(lc, [tool]);
  const msg = await runner.run(tool.name, { command: 'echo "hello from $(basename $SHELL 2>/dev/null || echo sh)"; pwd' });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /hello from/);
  const [req] = execRequests(mark);
  assert.equal(req.body.lang, 'bash');
});

test('a token signed by a key the broker does not trust is refused, and the tool reports "not authorized"', async () => {
  const { generateKeyPairSync } = await import('node:crypto');
  const { mintLibreChatJwt } = await import('../lib/broker.mjs');
  const stranger = generateKeyPairSync('ed25519').privateKey;
  const token = mintLibreChatJwt({ privateKey: stranger, sub: USER });
  const runner = toolRunner(lc, [codeTool({ token })]);
  const msg = await runner.run('execute_code', { lang: 'py', code: 'print(1)' });
  assert.equal(msg.status, 'error');
  assert.match(contentText(msg), /Code execution is not authorized/);
});

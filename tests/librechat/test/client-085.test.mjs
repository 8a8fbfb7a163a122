// LibreChat of the 0.8.5 era against codebroker, through the real client of that era:
// @librechat/agents 3.1.77, run by its own ToolNode.
//
// This generation sends no auth header at all: LibreChat builds the tool as
//   createCodeExecutionTool({ user_id, files, ...authValues })   // authValues = { LIBRECHAT_CODE_API_KEY }
// and the package spreads those params into the JSON body (src/tools/CodeExecutor.ts,
// `postData = { lang, code, ...rest, ...params }`), so the key travels as the body field
// LIBRECHAT_CODE_API_KEY. The base URL is read once, when the module loads
// (`const baseEndpoint = getCodeBaseURL()`). ToolNode passes earlier outputs back as
// `_injected_files` refs {session_id, id, name} (src/tools/ToolNode.ts), never a session_id.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startBroker } from '../lib/broker.mjs';
import {
  recordingProxy, call, show, download, form, sha256, ID_RE, parseHashes,
  PY_PLOT_AND_CSV, PY_NEXT_TURN, SQUARES_CSV, PNG_MAGIC,
} from '../lib/http.mjs';
import { loadAgents, toolRunner, contentText } from '../lib/agents.mjs';

const USER = '665f1c2e9b1e8a0012345602';
let broker;
let proxy;
let lc;

before(async () => {
  broker = await startBroker();
  proxy = await recordingProxy(broker.root);
  process.env.LIBRECHAT_CODE_BASEURL = `${proxy.url}/v1`;
  lc = await loadAgents('librechat-agents-085');
});

after(async () => {
  await proxy?.close();
  await broker?.stop();
});

function codeTool(files) {
  return lc.agents.createCodeExecutionTool({
    user_id: USER,
    ...(files ? { files } : {}),
    LIBRECHAT_CODE_API_KEY: broker.apiKey,
  });
}

const keyHeader = () => ({ 'X-API-Key': broker.apiKey });

function execRequests(mark) {
  return proxy.since(mark).filter((e) => e.method === 'POST' && e.url === '/v1/exec');
}

test('package 3.1.x: the key goes in the body, no auth header', async () => {
  assert.match(lc.version, /^3\.1\./);
  // This generation no longer knows the key at all (EnvVar has only CODE_BASEURL): it is
  // LibreChat's authValues that put LIBRECHAT_CODE_API_KEY into the params.
  assert.equal(lc.agents.EnvVar.CODE_API_KEY, undefined);
  assert.equal(lc.agents.EnvVar.CODE_BASEURL, 'LIBRECHAT_CODE_BASEURL');
  const mark = proxy.log.length;
  const runner = toolRunner(lc, [codeTool()]);
  const msg = await runner.run('execute_code', { lang: 'py', code: 'print(6 * 7)' });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\n42');
  assert.match(msg.artifact.session_id, ID_RE);

  const [req] = execRequests(mark);
  assert.equal(req.headers['x-api-key'], undefined);
  assert.equal(req.headers.authorization, undefined);
  assert.deepEqual(req.body, { lang: 'py', code: 'print(6 * 7)', user_id: USER, LIBRECHAT_CODE_API_KEY: broker.apiKey });
  assert.equal(req.status, 200);
});

test('package 3.1.x: a wrong body key is refused', async () => {
  const tool = lc.agents.createCodeExecutionTool({ user_id: USER, LIBRECHAT_CODE_API_KEY: 'not-the-key' });
  const runner = toolRunner(lc, [tool]);
  const msg = await runner.run('execute_code', { lang: 'py', code: 'print(1)' });
  assert.equal(msg.status, 'error');
  assert.match(contentText(msg), /HTTP error! status: 401/);
});

test('package 3.1.x: an exception lands in stderr', async () => {
  const runner = toolRunner(lc, [codeTool()]);
  const msg = await runner.run('execute_code', { lang: 'py', code: '1/0' });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout: Empty\. Ensure you're writing output explicitly\.\nstderr:\n[\s\S]*ZeroDivisionError/);
});

test('package 3.1.x: PNG + CSV listed as the package formats them, downloaded byte for byte; the next call finds the session through {session_id,id,name} refs', async () => {
  const mark = proxy.log.length;
  const runner = toolRunner(lc, [codeTool()]);
  const first = await runner.run('execute_code', { lang: 'py', code: PY_PLOT_AND_CSV });
  assert.equal(first.status, 'success', contentText(first));
  const text = contentText(first);
  const art = first.artifact;
  const png = art.files.find((f) => f.name.endsWith('.png'));
  const csv = art.files.find((f) => f.name === 'squares.csv');
  assert.ok(png && csv, JSON.stringify(art.files));
  assert.equal(art.files.length, 2);
  // src/tools/CodeExecutor.ts renderFileSection
  assert.match(text, /\nGenerated files:\n/);
  assert.ok(text.includes(`- /mnt/data/${png.name} | Image is already displayed to the user`), text);
  assert.ok(text.includes('- /mnt/data/squares.csv | File is already downloaded by the user'), text);
  assert.ok(text.endsWith('Note: Files from previous executions are automatically available and can be modified.'), text);

  const hashes = parseHashes(text);
  const csvDl = await download(broker.v1, art.session_id, csv.id, keyHeader());
  assert.equal(sha256(csvDl.bytes), hashes['squares.csv'][1]);
  assert.equal(csvDl.text, SQUARES_CSV);
  const pngDl = await download(broker.v1, art.session_id, png.id, keyHeader());
  assert.deepEqual([...pngDl.bytes.subarray(0, 8)], PNG_MAGIC);

  const second = await runner.run('execute_code', { lang: 'py', code: PY_NEXT_TURN });
  assert.equal(second.status, 'success', contentText(second));
  const sent = execRequests(mark)[1].body;
  assert.equal(sent.session_id, undefined);
  assert.deepEqual(
    sent.files.map((f) => Object.keys(f).sort().join(',')),
    sent.files.map(() => 'id,name,session_id'),
  );
  assert.deepEqual(sent.files.map((f) => f.session_id), sent.files.map(() => art.session_id));
  const out = contentText(second);
  assert.equal(second.artifact.session_id, art.session_id, 'the refs led the broker back to the first session');
  assert.match(out, /'squares\.csv'/);
  assert.match(out, /\n4,16\n/);
  assert.match(out, /kept-between-calls/, `a global set in call 1 is visible in call 2: ${out}`);
});

test('package 3.1.x: a CSV uploaded the classic way (entity_id + file) and primed as {id, session_id, name} is read by pandas', async () => {
  const up = await call(`${broker.v1}/upload`, {
    method: 'POST',
    headers: { ...keyHeader(), 'User-Id': USER, 'User-Agent': 'LibreChat/1.0' },
    body: form({ entity_id: 'agent_085' }, [{ name: 'sales.csv', data: 'region,amount\nnorth,10\nsouth,32\n', type: 'text/csv' }]),
  });
  assert.equal(up.status, 200, show(up));
  const ref = { id: up.json.files[0].fileId, session_id: up.json.session_id, name: 'sales.csv' };
  const runner = toolRunner(lc, [codeTool([ref])]);
  const msg = await runner.run('execute_code', {
    lang: 'py',
    code: "import pandas as pd\ndf = pd.read_csv('/mnt/data/sales.csv')\nprint(int(df.amount.sum()))",
  });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.match(contentText(msg), /^stdout:\n42\n?/);
});

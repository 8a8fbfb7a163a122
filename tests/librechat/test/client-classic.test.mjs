// Classic LibreChat (up to about v0.8.4) against codebroker, through the real client of
// that generation: @librechat/agents 3.0.50.
//
// LibreChat builds the tool as createCodeExecutionTool({ user_id, files, LIBRECHAT_CODE_API_KEY })
// (api/app/clients/tools/util/handleTools.js); the package sends `X-API-Key` (from that
// param, `apiKey`, or the LIBRECHAT_CODE_API_KEY env var) and, because it spreads its params
// into the body, the key and user_id in the JSON too (src/tools/CodeExecutor.ts). The base
// URL is read once at module load. Continuity is the model's job here: the tool output
// says `session_id: S`, the model passes `session_id` back as a tool argument, and the
// package then lists `GET /files/S?detail=full`, turns each entry into a ref
// {session_id, id: name.split('/')[1].split('.')[0], name: metadata['original-filename']}
// and sends those refs (not the session_id) with the exec.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startBroker } from '../lib/broker.mjs';
import {
  recordingProxy, call, show, download, form, sha256, ID_RE, parseHashes,
  PY_PLOT_AND_CSV, PY_NEXT_TURN, SQUARES_CSV, PNG_MAGIC,
} from '../lib/http.mjs';
import { loadAgents, contentText } from '../lib/agents.mjs';

const USER = '665f1c2e9b1e8a0012345603';
let broker;
let proxy;
let lc;

before(async () => {
  broker = await startBroker();
  proxy = await recordingProxy(broker.root);
  process.env.LIBRECHAT_CODE_BASEURL = `${proxy.url}/v1`;
  lc = await loadAgents('librechat-agents-classic');
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

let callNo = 0;
/** One tool call as the agent graph makes it: a ToolCall in, a ToolMessage (content + artifact) out. */
async function run(tool, args) {
  const id = `call_classic_${++callNo}`;
  try {
    return await tool.invoke({ id, name: tool.name, args, type: 'tool_call' });
  } catch (err) {
    return { status: 'error', content: String(err?.message ?? err), artifact: undefined };
  }
}

const keyHeader = () => ({ 'X-API-Key': broker.apiKey });

test('package 3.0.x: LIBRECHAT_CODE_API_KEY -> X-API-Key, stdout formatted as the package does', async () => {
  assert.match(lc.version, /^3\.0\./);
  assert.equal(lc.agents.EnvVar.CODE_API_KEY, 'LIBRECHAT_CODE_API_KEY');
  assert.equal(lc.agents.EnvVar.CODE_BASEURL, 'LIBRECHAT_CODE_BASEURL');
  const mark = proxy.log.length;
  const msg = await run(codeTool(), { lang: 'py', code: 'print("hello classic")' });
  assert.notEqual(msg.status, 'error', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\nhello classic');
  assert.match(msg.artifact.session_id, ID_RE);

  const [req] = proxy.since(mark);
  assert.equal(req.url, '/v1/exec');
  assert.equal(req.headers['x-api-key'], broker.apiKey);
  assert.deepEqual(req.body, {
    lang: 'py', code: 'print("hello classic")', user_id: USER, LIBRECHAT_CODE_API_KEY: broker.apiKey,
  });
});

test('package 3.0.x: an exception lands in stderr', async () => {
  const msg = await run(codeTool(), { lang: 'py', code: 'import json\njson.loads("{nope")' });
  assert.notEqual(msg.status, 'error', contentText(msg));
  assert.match(contentText(msg), /stderr:\n[\s\S]*JSONDecodeError/);
});

test('package 3.0.x: PNG + CSV listed with session_id, downloaded byte for byte; session_id passed back finds the files and the state', async () => {
  const tool = codeTool();
  const first = await run(tool, { lang: 'py', code: PY_PLOT_AND_CSV });
  assert.notEqual(first.status, 'error', contentText(first));
  const text = contentText(first);
  const art = first.artifact;
  assert.match(art.session_id, ID_RE);
  const png = art.files.find((f) => f.name.endsWith('.png'));
  const csv = art.files.find((f) => f.name === 'squares.csv');
  assert.ok(png && csv, JSON.stringify(art.files));
  assert.ok(text.includes(`- /mnt/data/${png.name} | Image is already displayed to the user`), text);
  assert.ok(text.includes('- /mnt/data/squares.csv | File is already downloaded by the user'), text);
  assert.ok(text.includes(`\nsession_id: ${art.session_id}\n`), text);

  const hashes = parseHashes(text);
  const csvDl = await download(broker.v1, art.session_id, csv.id, keyHeader());
  assert.equal(sha256(csvDl.bytes), hashes['squares.csv'][1]);
  assert.equal(csvDl.text, SQUARES_CSV);
  assert.match(csvDl.headers.get('content-disposition'), /filename\*=UTF-8''squares\.csv/);
  const pngDl = await download(broker.v1, art.session_id, png.id, keyHeader());
  assert.deepEqual([...pngDl.bytes.subarray(0, 8)], PNG_MAGIC);

  // The model passes session_id back.
  const mark = proxy.log.length;
  const second = await run(tool, { lang: 'py', code: PY_NEXT_TURN, session_id: art.session_id });
  assert.notEqual(second.status, 'error', contentText(second));
  const [list, exec] = proxy.since(mark);
  assert.equal(list.method, 'GET');
  assert.equal(list.url, `/v1/files/${art.session_id}?detail=full`);
  assert.equal(list.headers['x-api-key'], broker.apiKey);
  assert.equal(list.status, 200, `GET ${list.url} answered ${list.status} ${JSON.stringify(list.response)}`);
  assert.ok(Array.isArray(list.response), JSON.stringify(list.response));
  assert.equal(exec.url, '/v1/exec');
  assert.equal(exec.body.session_id, undefined, 'the package strips session_id from the body');
  const refs = exec.body.files ?? [];
  assert.deepEqual(
    refs.map((r) => `${r.session_id}/${r.id}/${r.name}`).sort(),
    art.files.map((f) => `${art.session_id}/${f.id}/${f.name}`).sort(),
    `refs the package built from ${JSON.stringify(list.response)}`,
  );
  const out = contentText(second);
  assert.equal(second.artifact.session_id, art.session_id, 'the refs led the broker back to the first session');
  assert.match(out, /'squares\.csv'/);
  assert.match(out, /\n4,16\n/);
  assert.match(out, /kept-between-calls/, `a global set in call 1 is visible in call 2: ${out}`);
});

test('package 3.0.x: an uploaded CSV (crud.js uploadCodeEnvFile) primed as {id, session_id, name} feeds pandas, whose plot and CSV download', async () => {
  const up = await call(`${broker.v1}/upload`, {
    method: 'POST',
    headers: { ...keyHeader(), 'User-Id': USER, 'User-Agent': 'LibreChat/1.0' },
    body: form({ entity_id: 'asst_classic' }, [{ name: 'grades.csv', data: 'name,score\nann,81\nbob,67\ncid,94\n', type: 'text/csv' }]),
  });
  assert.equal(up.status, 200, show(up));
  assert.equal(up.json.message, 'success');
  const ref = { id: up.json.files[0].fileId, session_id: up.json.session_id, name: 'grades.csv' };
  const msg = await run(codeTool([ref]), {
    lang: 'py',
    code: `import pandas as pd, matplotlib.pyplot as plt
df = pd.read_csv('/mnt/data/grades.csv')
df['passed'] = df.score >= 70
df.to_csv('/mnt/data/graded.csv', index=False)
df.plot.bar(x='name', y='score')
plt.savefig('/mnt/data/grades.png')
print(df.passed.sum())`,
  });
  assert.notEqual(msg.status, 'error', contentText(msg));
  assert.match(contentText(msg), /^stdout:\n2\n/);
  const names = msg.artifact.files.filter((f) => f.inherited !== true).map((f) => f.name).sort();
  assert.deepEqual(names, ['graded.csv', 'grades.png']);
  const graded = msg.artifact.files.find((f) => f.name === 'graded.csv');
  const dl = await download(broker.v1, msg.artifact.session_id, graded.id, keyHeader());
  assert.equal(dl.text, 'name,score,passed\nann,81,True\nbob,67,False\ncid,94,True\n');
  const img = msg.artifact.files.find((f) => f.name === 'grades.png');
  const imgDl = await download(broker.v1, msg.artifact.session_id, img.id, keyHeader());
  assert.deepEqual([...imgDl.bytes.subarray(0, 8)], PNG_MAGIC);
});

// LibreChat 0.8.6+ without its JWT sends no key at all; what works is the key in the base
// URL, `LIBRECHAT_CODE_BASEURL=http://<key>@host/v1`. Each HTTP client turns it into HTTP
// Basic credentials its own way: node-fetch 2 (the agents package's execs) sends
// `Basic base64("<key>")`, axios (LibreChat's server: uploads, freshness checks,
// downloads) `Basic base64("<key>:")`. codebroker takes the key from either part
// (docs/API.md, "Identity and auth"). The real tools are built with such a base URL and no
// auth headers; the recording proxy shows what they sent.
//
// node-fetch 2.7.0 is this folder's top-level dependency, as in LibreChat's server: with
// node-fetch 3 hoisted instead, a URL with credentials throws before anything is sent.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { startBroker } from '../lib/broker.mjs';
import { recordingProxy, call, show, ID_RE } from '../lib/http.mjs';
import { loadAgents, toolRunner, contentText } from '../lib/agents.mjs';
import { batchUploadCodeEnvFiles, getCodeFileInfo, uploadCodeEnvFile } from '../lib/server-calls.mjs';

const ALICE = '665f1c2e9b1e8a0012345621';
const BOB = '665f1c2e9b1e8a0012345622';
const KEY_A = randomBytes(16).toString('hex');
const KEY_B = randomBytes(16).toString('hex');
const b64 = (s) => Buffer.from(s).toString('base64');

let broker;
let proxy;
let lc;

before(async () => {
  broker = await startBroker({ jwt: true, env: { CODEBROKER_API_KEY: `${KEY_A},${KEY_B}` } });
  proxy = await recordingProxy(broker.root);
  lc = await loadAgents('@librechat/agents');
});

after(async () => {
  await proxy?.close();
  await broker?.stop();
});

/** The proxy's base URL with `userinfo` in it, as an operator writes LIBRECHAT_CODE_BASEURL. */
const withCredentials = (userinfo) => `${proxy.url.replace('http://', `http://${userinfo}@`)}/v1`;

function execsSince(mark) {
  return proxy.since(mark).filter((e) => e.url === '/v1/exec');
}

async function runTool(tool, name, args) {
  return toolRunner(lc, [tool]).run(name, args);
}

test('execute_code with `<key>@` in the base URL: node-fetch sends Basic base64(key), the exec runs', async () => {
  const mark = proxy.log.length;
  const tool = lc.agents.createCodeExecutionTool({ user_id: ALICE, baseUrl: withCredentials(KEY_A) });
  const msg = await runTool(tool, 'execute_code', { lang: 'py', code: 'print(6 * 7)' });
  assert.equal(msg.status, 'success', contentText(msg));
  assert.equal(contentText(msg), 'stdout:\n42');
  const [req] = execsSince(mark);
  assert.equal(req.headers.authorization, `Basic ${b64(KEY_A)}`);
  assert.equal(req.status, 200);
});

test('the same from LIBRECHAT_CODE_BASEURL, for bash_tool too, and `:<key>@` (the key as the password)', async () => {
  const mark = proxy.log.length;
  process.env.LIBRECHAT_CODE_BASEURL = withCredentials(`:${KEY_B}`);
  try {
    const code = lc.agents.createCodeExecutionTool({ user_id: ALICE });
    const bash = lc.agents.createBashExecutionTool({ user_id: ALICE });
    const a = await runTool(code, 'execute_code', { lang: 'py', code: 'print("from env")' });
    assert.equal(contentText(a), 'stdout:\nfrom env');
    const b = await runTool(bash, bash.name, { command: 'echo from bash' });
    assert.match(contentText(b), /from bash/);
  } finally {
    delete process.env.LIBRECHAT_CODE_BASEURL;
  }
  const sent = execsSince(mark);
  assert.equal(sent.length, 2);
  for (const req of sent) {
    assert.equal(req.headers.authorization, `Basic ${b64(`:${KEY_B}`)}`);
    assert.equal(req.status, 200);
  }
});

test('a wrong key in the URL: 401 with a Basic challenge, and the tool says "not authorized"', async () => {
  const mark = proxy.log.length;
  const tool = lc.agents.createCodeExecutionTool({ user_id: ALICE, baseUrl: withCredentials('not-the-key') });
  const msg = await runTool(tool, 'execute_code', { lang: 'py', code: 'print(1)' });
  assert.equal(msg.status, 'error');
  assert.match(contentText(msg), /Code execution is not authorized/);
  const [req] = execsSince(mark);
  assert.equal(req.status, 401);
  assert.equal(req.response.error, 'unauthorized');
  assert.match(req.response.message, /no configured API key/);
  const direct = await call(`${broker.v1}/exec`, {
    method: 'POST',
    headers: { Authorization: `Basic ${b64('not-the-key:')}`, 'Content-Type': 'application/json' },
    body: JSON.stringify({ lang: 'py', code: 'print(1)' }),
  });
  assert.equal(direct.status, 401, show(direct));
  assert.equal(direct.headers.get('www-authenticate'), 'Basic realm="codebroker", charset="UTF-8"');
});

test('LibreChat\'s server (axios) with the same URL: Basic base64("key:"); a skill it uploads serves every user of the key', async () => {
  const mark = proxy.log.length;
  const base = withCredentials(KEY_A);
  const up = await batchUploadCodeEnvFiles({
    baseURL: base, userId: ALICE, kind: 'skill', id: 'skill_basic', version: 1, read_only: true,
    files: [{ name: 'skills/hello/SKILL.md', data: '# Hello\n' }, { name: 'skills/hello/greeting.txt', data: 'hello from the skill\n' }],
  });
  assert.equal(up.status, 200, JSON.stringify(up.data));
  const [uploadReq] = proxy.since(mark).filter((e) => e.url === '/v1/upload/batch');
  assert.equal(uploadReq.headers.authorization, `Basic ${b64(`${KEY_A}:`)}`);
  const S = up.data.storage_session_id;
  const greeting = up.data.files.find((f) => f.filename === 'skills/hello/greeting.txt');
  const ref = { id: greeting.fileId, resource_id: 'skill_basic', storage_session_id: S, name: greeting.filename, kind: 'skill', version: 1 };

  // Bob's turn: the freshness check passes (same key), and his exec gets the file.
  const info = await getCodeFileInfo({ baseURL: base, headers: { 'User-Id': BOB }, ref });
  assert.equal(info?.originalFilename, 'skills/hello/greeting.txt');
  const tool = lc.agents.createCodeExecutionTool({ user_id: BOB, baseUrl: base, files: [ref] });
  const msg = await runTool(tool, 'execute_code', { lang: 'bash', code: 'cat skills/hello/greeting.txt' });
  assert.equal(contentText(msg), 'stdout:\nhello from the skill');
  assert.match(msg.artifact.session_id, ID_RE);
  assert.notEqual(msg.artifact.session_id, S);

  // The other key is another tenant: a miss for LibreChat, a missing input for the exec.
  const other = withCredentials(KEY_B);
  assert.equal(await getCodeFileInfo({ baseURL: other, headers: { 'User-Id': BOB }, ref }), null);
  const theirs = lc.agents.createCodeExecutionTool({ user_id: BOB, baseUrl: other, files: [ref] });
  const miss = await runTool(theirs, 'execute_code', { lang: 'bash', code: 'cat skills/hello/greeting.txt 2>/dev/null || echo missing' });
  assert.match(contentText(miss), /^stdout:\nmissing/);

  // A chat file uploaded through the URL stays Alice's.
  const mine = await uploadCodeEnvFile({ baseURL: base, userId: ALICE, file: { name: 'a.txt', data: 'alice\n' }, kind: 'user', id: ALICE });
  assert.equal(mine.status, 200, JSON.stringify(mine.data));
  const mineRef = { id: mine.data.files[0].fileId, resource_id: ALICE, storage_session_id: mine.data.storage_session_id, kind: 'user' };
  assert.ok(await getCodeFileInfo({ baseURL: base, headers: { 'User-Id': ALICE }, ref: mineRef }));
  assert.equal(await getCodeFileInfo({ baseURL: base, headers: { 'User-Id': BOB }, ref: mineRef }), null);
});

test('a JWT and credentials in the URL: node-fetch keeps the Bearer (the exec is the JWT user\'s), axios sends Basic', async () => {
  const mark = proxy.log.length;
  const base = withCredentials(KEY_A);
  const tool = lc.agents.createCodeExecutionTool({
    user_id: ALICE, baseUrl: base, authHeaders: () => ({ Authorization: `Bearer ${broker.mintJwt(ALICE)}` }),
  });
  const msg = await runTool(tool, 'execute_code', { lang: 'py', code: 'print("jwt")' });
  assert.equal(contentText(msg), 'stdout:\njwt');
  const [req] = execsSince(mark);
  assert.match(req.headers.authorization, /^Bearer ey/);
  const up = await uploadCodeEnvFile({
    baseURL: base, headers: { Authorization: `Bearer ${broker.mintJwt(ALICE)}` }, userId: ALICE,
    file: { name: 'b.txt', data: 'b\n' }, kind: 'user', id: ALICE,
  });
  assert.equal(up.status, 200, JSON.stringify(up.data));
  const [uploadReq] = proxy.since(mark).filter((e) => e.url === '/v1/upload');
  assert.equal(uploadReq.headers.authorization, `Basic ${b64(`${KEY_A}:`)}`, 'axios replaced the Bearer');
});

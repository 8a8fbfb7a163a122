// Skills and agent files shared across users, the way LibreChat (v0.8.5+) uses them: its
// server primes a skill once per (skill, version) with one batch upload
// (kind=skill, read_only) and reuses the refs for every user while its freshness check
// says they are under 23 h old; @librechat/agents 3.9.x then injects the refs into each
// user's execute_code calls. LibreChat's own code server shares such files within a
// tenant (the JWT's tenant_id); so does codebroker (docs/API.md, "Shared files"):
//
//   - alice and bob (same tenant_id): the freshness checks pass for both, so LibreChat
//     uploads once; both execs get the files read-only, each in a session of its own;
//     what an exec writes stays its user's; code cannot change the skill for the next user;
//   - carol (another tenant_id): 404 / [] / a missing input, as for ids that do not exist;
//   - key mode (LibreChat's server with the API key, naming its users): the same per key.
//
// The server's calls are made as it makes them (lib/server-calls.mjs: axios + form-data);
// the execs go through the real createCodeExecutionTool run by its own ToolNode.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { startBroker } from '../lib/broker.mjs';
import { recordingProxy, call, show, ID_RE } from '../lib/http.mjs';
import { loadAgents, toolRunner, contentText } from '../lib/agents.mjs';
import {
  batchUploadCodeEnvFiles, uploadCodeEnvFile, getCodeFileInfo, checkSessionsAlive, primedRefsAreFresh,
} from '../lib/server-calls.mjs';

const ALICE = '665f1c2e9b1e8a0012345611';
const BOB = '665f1c2e9b1e8a0012345612';
const CAROL = '665f1c2e9b1e8a0012345613';
const SKILL_ID = '6650aa11bb22cc33dd44ee55';
const SKILL_FILES = [
  { name: 'skills/report/SKILL.md', data: '# Report\nRun scripts/make.py.\n' },
  { name: 'skills/report/scripts/make.py', data: "open('/mnt/data/report.txt', 'w').write('report by the skill\\n')\nprint('made report.txt')\n" },
  { name: 'skills/report/template.txt', data: 'TEMPLATE v3\n' },
];
const KEY_A = randomBytes(16).toString('hex');
const KEY_B = randomBytes(16).toString('hex');

let broker;
let proxy;
let lc;

before(async () => {
  broker = await startBroker({ jwt: true, env: { CODEBROKER_API_KEY: `${KEY_A},${KEY_B}` } });
  proxy = await recordingProxy(broker.root);
  process.env.LIBRECHAT_CODE_BASEURL = `${proxy.url}/v1`;
  lc = await loadAgents('@librechat/agents');
});

after(async () => {
  await proxy?.close();
  await broker?.stop();
});

const bearer = (sub, tenant_id) => ({ Authorization: `Bearer ${broker.mintJwt(sub, { tenant_id })}` });

/** LibreChat's skill priming: one batch, every file back, SKILL.md left out of the refs. */
async function primeSkill(headers, userId) {
  const up = await batchUploadCodeEnvFiles({
    baseURL: broker.v1, headers, userId, files: SKILL_FILES, kind: 'skill', id: SKILL_ID, version: 3, read_only: true,
  });
  assert.equal(up.status, 200, JSON.stringify(up.data));
  assert.equal(up.data.message, 'success');
  assert.equal(up.data.files.length, SKILL_FILES.length, 'a partial upload fails priming');
  const S = up.data.storage_session_id;
  assert.match(S, ID_RE);
  return up.data.files
    .filter((f) => f.status === 'success' && f.fileId && !f.filename.endsWith('/SKILL.md'))
    .map((f) => ({ id: f.fileId, resource_id: SKILL_ID, storage_session_id: S, name: f.filename, kind: 'skill', version: 3 }));
}

function codeTool({ user, files, authHeaders }) {
  return lc.agents.createCodeExecutionTool({ user_id: user, files, authHeaders: () => authHeaders() });
}

/** The exec of a file ref: where it ran, what it printed, what it made. */
async function runWith(tool, code) {
  const msg = await toolRunner(lc, [tool]).run('execute_code', { lang: 'py', code });
  assert.equal(msg.status, 'success', contentText(msg));
  const made = (msg.artifact.files ?? []).filter((f) => f.inherited !== true);
  return { text: contentText(msg), session: msg.artifact.session_id, made };
}

const TAMPER = `
import os, subprocess
t = '/mnt/data/skills/report/template.txt'
print('template', open(t).read().strip())
for name, attempt in [('write', lambda: open(t, 'w').write('EVIL')), ('remove', lambda: os.remove(t))]:
    try:
        attempt()
        print(name, 'done')
    except OSError as e:
        print(name, 'refused')
print(subprocess.run(['python3', '/mnt/data/skills/report/scripts/make.py'], capture_output=True, text=True).stdout.strip())
`;

test('JWT: one skill upload serves every user of the tenant, read-only; another tenant sees nothing', async () => {
  const alice = () => bearer(ALICE, 'acme');
  const bob = () => bearer(BOB, 'acme');
  const carol = () => bearer(CAROL, 'globex');
  const refs = await primeSkill(alice(), ALICE);

  // Bob's turn: LibreChat checks the stored refs before it uploads again. Both probes pass,
  // so nothing is uploaded.
  for (const [who, h] of [['alice', alice], ['bob', bob]]) {
    assert.equal(await primedRefsAreFresh({ baseURL: broker.v1, headers: h(), refs }), true, who);
    const info = await getCodeFileInfo({ baseURL: broker.v1, headers: h(), ref: refs[0] });
    assert.equal(info.originalFilename, refs[0].name, who);
    assert.equal(await checkSessionsAlive({ baseURL: broker.v1, headers: h(), ref: refs[0] }), 'alive', who);
  }
  // Carol's tenant: a miss, so her LibreChat would upload its own copy.
  assert.equal(await primedRefsAreFresh({ baseURL: broker.v1, headers: carol(), refs }), false);
  assert.equal(await checkSessionsAlive({ baseURL: broker.v1, headers: carol(), ref: refs[0] }), 'expired');
  const dl = await call(`${broker.v1}/download/${refs[0].storage_session_id}/${refs[0].id}`, { headers: carol() });
  assert.equal(dl.status, 404, show(dl));

  // Bob's exec through the real tool: the files are there, read-only; the skill's script
  // writes into bob's session, not the skill's.
  const mark = proxy.log.length;
  const byBob = await runWith(codeTool({ user: BOB, files: refs, authHeaders: bob }), TAMPER);
  // Files moved through the runner (make test-runner-files, and always on the Kubernetes
  // backend) are the sandbox user's own, so a remove succeeds there; the broker then puts
  // the file back and says so.
  if (process.env.CODEBROKER_FILE_TRANSFER === 'runner' || /^kubernetes$/i.test(process.env.CODEBROKER_BACKEND ?? '')) {
    assert.match(byBob.text, /template TEMPLATE v3\nwrite refused\nremove done\nmade report\.txt/);
    assert.match(byBob.text, /skills\/report\/template\.txt is a read-only upload; it was put back in \/mnt\/data/);
  } else {
    assert.match(byBob.text, /template TEMPLATE v3\nwrite refused\nremove refused\nmade report\.txt/);
  }
  assert.deepEqual(byBob.made.map((f) => f.name), ['report.txt']);
  assert.notEqual(byBob.session, refs[0].storage_session_id);
  const [sent] = proxy.since(mark).filter((e) => e.url === '/v1/exec');
  assert.deepEqual(sent.body.files.map((f) => f.kind), ['skill', 'skill'], 'the tool sent the skill refs');
  const report = byBob.made[0];
  const mine = await call(`${broker.v1}/download/${byBob.session}/${report.id}`, { headers: bob() });
  assert.equal(mine.status, 200, show(mine));
  assert.equal(mine.text, 'report by the skill\n');
  const notAlices = await call(`${broker.v1}/download/${byBob.session}/${report.id}`, { headers: alice() });
  assert.equal(notAlices.status, 404, 'outputs stay the user\'s');

  // Alice's exec next: the template as uploaded, none of bob's files, a session of hers.
  const byAlice = await runWith(
    codeTool({ user: ALICE, files: refs, authHeaders: alice }),
    "import os\nprint(open('/mnt/data/skills/report/template.txt').read().strip())\nprint(os.path.exists('/mnt/data/report.txt'))",
  );
  assert.match(byAlice.text, /^stdout:\nTEMPLATE v3\nFalse/);
  assert.notEqual(byAlice.session, byBob.session);
  // The skill's session is as uploaded: its own files, nothing an exec wrote.
  const listed = await call(`${broker.v1}/files/${refs[0].storage_session_id}?detail=full`, { headers: alice() });
  assert.deepEqual(listed.json.map((f) => f.metadata['original-filename']).sort(), SKILL_FILES.map((f) => f.name).sort());
  // Nobody deletes it, the uploader neither; another tenant gets 404.
  for (const [h, status] of [[alice, 403], [bob, 403], [carol, 404]]) {
    const del = await call(`${broker.v1}/sessions/${refs[0].storage_session_id}/objects/${refs[0].id}`, { method: 'DELETE', headers: h() });
    assert.equal(del.status, status, show(del));
  }

  // Carol's exec with the refs (say, leaked): the code runs, the inputs are missing.
  const byCarol = await runWith(
    codeTool({ user: CAROL, files: refs, authHeaders: carol }),
    "import os\nprint(os.path.exists('/mnt/data/skills/report/template.txt'))",
  );
  assert.match(byCarol.text, /^stdout:\nFalse\n/);
  assert.match(byCarol.text, /skills\/report\/template\.txt/, 'stderr names the missing input');
});

test('JWT: a chat file (kind=user) stays its user\'s; a token without tenant_id is in the default tenant', async () => {
  const up = await uploadCodeEnvFile({
    baseURL: broker.v1, headers: bearer(ALICE, 'acme'), userId: ALICE,
    file: { name: 'private.csv', data: 'a,b\n1,2\n' }, kind: 'user', id: ALICE,
  });
  assert.equal(up.status, 200, JSON.stringify(up.data));
  const ref = { id: up.data.files[0].fileId, resource_id: ALICE, storage_session_id: up.data.storage_session_id, name: 'private.csv', kind: 'user' };
  assert.ok(await getCodeFileInfo({ baseURL: broker.v1, headers: bearer(ALICE, 'acme'), ref }));
  assert.equal(await getCodeFileInfo({ baseURL: broker.v1, headers: bearer(BOB, 'acme'), ref }), null);

  const legacy = await primeSkill(bearer(ALICE, null), ALICE);
  assert.equal(await primedRefsAreFresh({ baseURL: broker.v1, headers: bearer(BOB, 'legacy'), refs: legacy }), true);
  assert.equal(await primedRefsAreFresh({ baseURL: broker.v1, headers: bearer(BOB, 'acme'), refs: legacy }), false);
});

test('key mode: the users a key names share its agent files; another key is another tenant', async () => {
  // LibreChat's server with the key (X-API-Key) names its user in User-Id; classic agent
  // files come with entity_id, new ones with kind=agent.
  const key = (k) => ({ 'X-API-Key': k });
  const agentUp = await uploadCodeEnvFile({
    baseURL: broker.v1, headers: key(KEY_A), userId: ALICE, file: { name: 'prices.csv', data: 'item,price\ntea,3\n' }, kind: 'agent', id: 'agent_pricing',
  });
  const classicUp = await uploadCodeEnvFile({
    baseURL: broker.v1, headers: key(KEY_A), userId: ALICE, file: { name: 'notes.txt', data: 'classic agent file\n' }, fields: { entity_id: 'asst_notes' },
  });
  for (const up of [agentUp, classicUp]) assert.equal(up.status, 200, JSON.stringify(up.data));
  const agentRef = { id: agentUp.data.files[0].fileId, resource_id: 'agent_pricing', storage_session_id: agentUp.data.storage_session_id, name: 'prices.csv', kind: 'agent' };
  const classicS = classicUp.data.session_id;
  const classicF = classicUp.data.files[0].fileId;

  for (const [who, headers, seen] of [
    ['bob, same key', { ...key(KEY_A), 'User-Id': BOB }, true],
    ['the key alone', key(KEY_A), true],
    ['alice, other key', { ...key(KEY_B), 'User-Id': ALICE }, false],
  ]) {
    assert.equal(Boolean(await getCodeFileInfo({ baseURL: broker.v1, headers, ref: agentRef })), seen, who);
    // Classic freshness: GET /files/S?detail=summary&entity_id=E, an entry named S/F<...>.
    const r = await call(`${broker.v1}/files/${classicS}?detail=summary&entity_id=asst_notes`, { headers });
    assert.equal(r.status, 200, show(r));
    assert.equal(r.json.some((f) => f.name.startsWith(`${classicS}/${classicF}`) && f.lastModified), seen, `${who}: ${show(r)}`);
  }

  // Bob's classic exec with both as refs: read-only copies in his own session.
  const exec = (headers, body) => call(`${broker.v1}/exec`, {
    method: 'POST', headers: { ...headers, 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  const files = [
    { id: agentRef.id, session_id: agentRef.storage_session_id, name: 'prices.csv' },
    { id: classicF, session_id: classicS, name: 'notes.txt' },
  ];
  const code = 'cat prices.csv notes.txt; echo more >> notes.txt 2>/dev/null || echo read-only';
  const r = await exec({ ...key(KEY_A), 'User-Id': BOB }, { lang: 'bash', code, user_id: BOB, files });
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.stdout, 'item,price\ntea,3\nclassic agent file\nread-only\n');
  assert.deepEqual(r.json.files, []);
  assert.ok(![agentRef.storage_session_id, classicS].includes(r.json.session_id));
  const other = await exec({ ...key(KEY_B), 'User-Id': BOB }, { lang: 'bash', code: 'ls; echo ran', user_id: BOB, files });
  assert.equal(other.status, 200, show(other));
  assert.equal(other.json.stdout, 'ran\n');
  assert.match(other.json.stderr, /notes\.txt/);
});

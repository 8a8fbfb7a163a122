// The file routes as LibreChat v0.8.5+ calls them, in plain HTTP, written to
// docs/API.md ("Files"): uploads carry `kind` / `id` / `version` instead of
// `entity_id`, single (`/upload`) or batched (`/upload/batch`); the upload is addressed by
// its storage session, checked with GET /sessions/{S}/objects/{F} and removed with DELETE
// on the same path; exec refs are {id, resource_id, storage_session_id, name, kind[, version]}.
// LibreChat authenticates these direct calls with its EdDSA JWT (sub = the user); the API
// key with a named user works the same.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { startBroker } from '../lib/broker.mjs';
import {
  call, show, download, form, sha256, ID_RE, PY_HASHES, parseHashes, PNG_MAGIC, postMultipartLikeAxios,
} from '../lib/http.mjs';

const USER = '665f1c2e9b1e8a0012345605';
const OTHER = '665f1c2e9b1e8a0012345698';
const CSV = 'month,revenue,cost\njan,100,80\nfeb,130,90\nmar,90,95\napr,160,100\n';
let broker;

before(async () => {
  broker = await startBroker({ jwt: true, env: { CODEBROKER_MAX_UPLOAD_MB: '1' } });
});

after(async () => {
  await broker?.stop();
});

const jwt = (user = USER) => ({ Authorization: `Bearer ${broker.mintJwt(user)}`, 'User-Agent': 'LibreChat/1.0' });
const userQuery = (user = USER) => `kind=user&id=${user}`;
const randomId = () => randomBytes(16).toString('base64url').slice(0, 21);

async function upload({ fields = { kind: 'user', id: USER }, files = [{ name: 'finance.csv', data: CSV, type: 'text/csv' }], user = USER, path = '/upload' } = {}) {
  const r = await call(`${broker.v1}${path}`, { method: 'POST', headers: jwt(user), body: form(fields, files) });
  assert.equal(r.status, 200, `POST ${path}: ${show(r)}`);
  return r;
}

async function exec(body, user = USER) {
  return call(`${broker.v1}/exec`, {
    method: 'POST',
    headers: { ...jwt(user), 'Content-Type': 'application/json' },
    body: JSON.stringify(body),
  });
}

const userRef = (S, F, name, user = USER) => ({ id: F, resource_id: user, storage_session_id: S, name, kind: 'user' });

test('POST /upload (new): kind=user, id -> success with storage_session_id (and session_id) and fileId', async () => {
  const r = await upload();
  assert.equal(r.json.message, 'success');
  assert.match(r.json.storage_session_id, ID_RE);
  assert.equal(r.json.session_id, r.json.storage_session_id);
  assert.equal(r.json.files.length, 1);
  assert.match(r.json.files[0].fileId, ID_RE);
  assert.equal(r.json.files[0].filename, 'finance.csv');
});

test('GET /sessions/{S}/objects/{F}: name, size, contentType, lastModified', async () => {
  const up = await upload();
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const r = await call(`${broker.v1}/sessions/${S}/objects/${F}?${userQuery()}`, { headers: jwt() });
  assert.equal(r.status, 200, show(r));
  assert.equal(typeof r.json.name, 'string');
  assert.equal(r.json.size, Buffer.byteLength(CSV));
  assert.match(r.json.contentType, /^text\/csv/);
  const age = Date.now() - new Date(r.json.lastModified).getTime();
  assert.ok(Number.isFinite(age) && Math.abs(age) < 60_000, `lastModified ${r.json.lastModified}`);
  // A caller with the key is in the key's tenant, never a JWT's: naming the user does not
  // reach the JWT user's session, which answers as unknown (SECURITY.md, "Tenants are
  // session boundaries").
  const byKey = await call(`${broker.v1}/sessions/${S}/objects/${F}?${userQuery()}`, { headers: { 'X-API-Key': broker.apiKey } });
  assert.equal(byKey.status, 404, show(byKey));
});

test('GET /files/{S}?detail=full&kind=user&id=U: id, storage_session_id, size, contentType, original filename', async () => {
  const up = await upload();
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const r = await call(`${broker.v1}/files/${S}?detail=full&${userQuery()}`, { headers: jwt() });
  assert.equal(r.status, 200, show(r));
  const entry = r.json.find((e) => e.id === F);
  assert.ok(entry, show(r));
  assert.equal(entry.storage_session_id, S);
  assert.equal(entry.size, Buffer.byteLength(CSV));
  assert.match(entry.contentType, /^text\/csv/);
  assert.equal(entry.metadata['original-filename'], 'finance.csv');
  assert.ok(entry.name.startsWith(`${S}/${F}`), entry.name);
  const summary = await call(`${broker.v1}/files/${S}?detail=summary&${userQuery()}`, { headers: jwt() });
  assert.equal(summary.status, 200, show(summary));
  assert.ok(summary.json.some((e) => e.name.startsWith(`${S}/${F}`) && e.lastModified), show(summary));
});

test('CSV upload -> pandas on /mnt/data/<name> (new refs) -> plot + CSV back -> both download byte for byte', async () => {
  const up = await upload();
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const r = await exec({
    lang: 'py',
    user_id: USER,
    files: [userRef(S, F, 'finance.csv')],
    code: `${PY_HASHES}
import os
import pandas as pd
import matplotlib.pyplot as plt
df = pd.read_csv('/mnt/data/finance.csv')
df['profit'] = df.revenue - df.cost
df.to_csv('/mnt/data/profit.csv', index=False)
fig, ax = plt.subplots()
ax.bar(df.month, df.profit)
plt.show()
print('total', int(df.profit.sum()))
_hashes('profit.csv', *[n for n in os.listdir('/mnt/data') if n.endswith('.png')])
`,
  });
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.stderr, '', r.json.stderr);
  assert.match(r.json.stdout, /^total 115\n/);
  const generated = r.json.files.filter((f) => f.inherited !== true);
  const names = generated.map((f) => f.name).sort();
  assert.equal(names.length, 2, JSON.stringify(r.json.files));
  assert.match(names[0], /\.png$/);
  assert.equal(names[1], 'profit.csv');
  const hashes = parseHashes(r.json.stdout);
  for (const f of generated) {
    assert.match(f.id, ID_RE);
    assert.match(f.storage_session_id, ID_RE);
    const dl = await download(broker.v1, r.json.session_id, f.id, jwt());
    if (hashes[f.name]) assert.equal(sha256(dl.bytes), hashes[f.name][1], f.name);
    if (f.name.endsWith('.png')) {
      assert.deepEqual([...dl.bytes.subarray(0, 8)], PNG_MAGIC);
    } else {
      assert.equal(dl.text, 'month,revenue,cost,profit\njan,100,80,20\nfeb,130,90,40\nmar,90,95,-5\napr,160,100,60\n');
    }
  }
  assert.ok(hashes['profit.csv'], 'the CSV was hashed in the sandbox');
  // An output passed back as a ref in a later call is found again.
  const csv = generated.find((f) => f.name === 'profit.csv');
  const again = await exec({
    lang: 'py',
    user_id: USER,
    files: [userRef(csv.storage_session_id, csv.id, 'profit.csv')],
    code: "print(open('/mnt/data/profit.csv').read().splitlines()[-1])",
  });
  assert.equal(again.status, 200, show(again));
  assert.equal(again.json.stdout, 'apr,160,100,60\n');
});

test('POST /upload/batch: two files, success with per-file status and counts; both usable in one exec', async () => {
  const r = await upload({
    path: '/upload/batch',
    files: [
      { name: 'left.txt', data: 'left side\n' },
      { name: 'right.txt', data: 'right side\n' },
    ],
  });
  assert.equal(r.json.message, 'success', show(r));
  assert.match(r.json.storage_session_id, ID_RE);
  assert.equal(r.json.succeeded, 2);
  assert.equal(r.json.failed, 0);
  assert.deepEqual(r.json.files.map((f) => f.status), ['success', 'success']);
  assert.deepEqual(r.json.files.map((f) => f.filename).sort(), ['left.txt', 'right.txt']);
  const S = r.json.storage_session_id;
  const refs = r.json.files.map((f) => userRef(S, f.fileId, f.filename));
  const x = await exec({ lang: 'bash', user_id: USER, files: refs, code: 'cat /mnt/data/left.txt /mnt/data/right.txt' });
  assert.equal(x.status, 200, show(x));
  assert.equal(x.json.stdout, 'left side\nright side\n');
});

test('POST /upload/batch: one file over the limit -> partial_success, the other stored', async () => {
  const r = await postMultipartLikeAxios(`${broker.v1}/upload/batch`, jwt(), form({ kind: 'user', id: USER }, [
    { name: 'small.txt', data: 'small\n' },
    { name: 'huge.bin', data: Buffer.alloc(1536 * 1024, 1) },
  ]));
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.message, 'partial_success', show(r));
  assert.equal(r.json.succeeded, 1);
  assert.equal(r.json.failed, 1);
  const ok = r.json.files.find((f) => f.filename === 'small.txt');
  const bad = r.json.files.find((f) => f.filename === 'huge.bin');
  assert.equal(ok.status, 'success');
  assert.match(ok.fileId, ID_RE);
  assert.equal(bad.status, 'error');
  assert.equal(typeof bad.error, 'string');
});

test('a skill file (kind=skill, version) is placed at its relative name and never reported as generated', async () => {
  const skillId = 'skill_6650aa11bb22cc33';
  const up = await upload({
    fields: { kind: 'skill', id: skillId, version: 3 },
    files: [{ name: 'SKILL.md', data: '# Demo skill\nSay hello.\n', type: 'text/markdown' }],
  });
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const r = await exec({
    lang: 'bash',
    user_id: USER,
    files: [{ id: F, resource_id: skillId, storage_session_id: S, name: 'skills/demo/SKILL.md', kind: 'skill', version: 3 }],
    code: 'head -1 /mnt/data/skills/demo/SKILL.md; echo made > /mnt/data/out.txt',
  });
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.stdout, '# Demo skill\n', r.json.stderr);
  const generated = r.json.files.filter((f) => f.inherited !== true).map((f) => f.name);
  assert.deepEqual(generated, ['out.txt']);
});

test('a read_only upload is never reported as a generated file, even when the code touches it', async () => {
  const up = await upload({
    fields: { kind: 'user', id: USER, read_only: 'true' },
    files: [{ name: 'ref.txt', data: 'reference\n' }],
  });
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const r = await exec({
    lang: 'py',
    user_id: USER,
    files: [userRef(S, F, 'ref.txt')],
    code: "try:\n    open('/mnt/data/ref.txt', 'a').write('changed\\n')\nexcept OSError as e:\n    print('refused', type(e).__name__)\nprint(open('/mnt/data/ref.txt').read().splitlines()[0])",
  });
  assert.equal(r.status, 200, show(r));
  assert.match(r.json.stdout, /reference\n$/);
  const generated = r.json.files.filter((f) => f.inherited !== true).map((f) => f.name);
  assert.deepEqual(generated, []);
});

test('DELETE /sessions/{S}/objects/{F} (and DELETE /files/{S}/{F}): deleted, then 404', async () => {
  const up = await upload({ files: [{ name: 'a.txt', data: 'a\n' }, { name: 'b.txt', data: 'b\n' }] });
  const S = up.json.storage_session_id;
  const [A, B] = up.json.files.map((f) => f.fileId);
  const del = await call(`${broker.v1}/sessions/${S}/objects/${A}?${userQuery()}`, { method: 'DELETE', headers: jwt() });
  assert.equal(del.status, 200, show(del));
  assert.deepEqual(del.json, { message: 'File deleted successfully', session_id: S, fileId: A });
  const head = await call(`${broker.v1}/sessions/${S}/objects/${A}?${userQuery()}`, { headers: jwt() });
  assert.equal(head.status, 404, show(head));
  const again = await call(`${broker.v1}/sessions/${S}/objects/${A}?${userQuery()}`, { method: 'DELETE', headers: jwt() });
  assert.equal(again.status, 404, show(again));
  const delB = await call(`${broker.v1}/files/${S}/${B}`, { method: 'DELETE', headers: jwt() });
  assert.equal(delB.status, 200, show(delB));
  assert.deepEqual(delB.json, { message: 'File deleted successfully', session_id: S, fileId: B });
  const list = await call(`${broker.v1}/files/${S}?detail=full&${userQuery()}`, { headers: jwt() });
  assert.equal(list.status, 200, show(list));
  assert.deepEqual(list.json.filter((e) => e.id === A || e.id === B), []);
});

test('another user (their own JWT) sees none of it: object 404, list [], download 404, exec with the ref 403', async () => {
  const up = await upload();
  const S = up.json.storage_session_id;
  const F = up.json.files[0].fileId;
  const head = await call(`${broker.v1}/sessions/${S}/objects/${F}?${userQuery(OTHER)}`, { headers: jwt(OTHER) });
  assert.equal(head.status, 404, show(head));
  const list = await call(`${broker.v1}/files/${S}?detail=full&${userQuery(OTHER)}`, { headers: jwt(OTHER) });
  assert.equal(list.status, 200, show(list));
  assert.deepEqual(list.json, []);
  const dl = await call(`${broker.v1}/download/${S}/${F}`, { headers: jwt(OTHER) });
  assert.equal(dl.status, 404, show(dl));
  // The JWT's sub wins over whatever the body says.
  const r = await exec({ lang: 'py', user_id: USER, code: 'print(1)', files: [userRef(S, F, 'finance.csv')] }, OTHER);
  assert.equal(r.status, 403, show(r));
});

test('ids: a malformed one in a path is 400, an unknown one 404', async () => {
  const up = await upload();
  const S = up.json.storage_session_id;
  const bad = await call(`${broker.v1}/sessions/${S}/objects/bad.id?${userQuery()}`, { headers: jwt() });
  assert.equal(bad.status, 400, show(bad));
  const unknown = await call(`${broker.v1}/sessions/${S}/objects/${randomId()}?${userQuery()}`, { headers: jwt() });
  assert.equal(unknown.status, 404, show(unknown));
  const unknownSession = await call(`${broker.v1}/sessions/${randomId()}/objects/${randomId()}?${userQuery()}`, { headers: jwt() });
  assert.equal(unknownSession.status, 404, show(unknownSession));
});

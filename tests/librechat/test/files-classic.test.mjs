// The file routes as classic LibreChat (up to about v0.8.4) calls them, in plain HTTP,
// written to docs/API.md ("Files") and to LibreChat's own calls:
//   upload   api/server/services/Files/Code/crud.js uploadCodeEnvFile: multipart `entity_id`
//            (when set) then `file`, headers X-API-Key + User-Id; reads
//            `${session_id}/${files[0].fileId}` from the answer
//   list     process.js getSessionInfo: GET /files/{S}?detail=summary[&entity_id=E], finds the
//            entry whose name starts with "S/F" and checks its lastModified is < 23 h old
//   refs     process.js primeFiles: {id, session_id, name} in the exec's `files`
//   download crud.js / process.js: GET /download/{S}/{F} with X-API-Key only

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { startBroker } from '../lib/broker.mjs';
import {
  call, show, download, form, sha256, ID_RE, PY_HASHES, parseHashes, PNG_MAGIC, postMultipartLikeAxios,
} from '../lib/http.mjs';

const USER = '665f1c2e9b1e8a0012345604';
const OTHER = '665f1c2e9b1e8a0012345699';
const CSV = 'day,visits\nmon,120\ntue,95\nwed,143\nthu,160\nfri,88\n';
let broker;

before(async () => {
  broker = await startBroker({ env: { CODEBROKER_MAX_UPLOAD_MB: '1' } });
});

after(async () => {
  await broker?.stop();
});

const headers = (user = USER) => ({ 'X-API-Key': broker.apiKey, 'User-Agent': 'LibreChat/1.0', ...(user ? { 'User-Id': user } : {}) });

async function upload({ name = 'visits.csv', data = CSV, entity_id, user = USER, base = broker.v1 } = {}) {
  const r = await call(`${base}/upload`, {
    method: 'POST',
    headers: headers(user),
    body: form({ entity_id }, [{ name, data, type: 'text/csv' }]),
  });
  assert.equal(r.status, 200, `POST /upload: ${show(r)}`);
  return r;
}

async function exec(body, user = USER) {
  return call(`${broker.v1}/exec`, {
    method: 'POST',
    headers: { ...headers(user), 'Content-Type': 'application/json' },
    body: JSON.stringify({ user_id: user, ...body }),
  });
}

const randomId = () => randomBytes(16).toString('base64url').slice(0, 21);

test('POST /upload (classic): entity_id + file -> success, session_id, storage_session_id, fileId', async () => {
  const r = await upload({ entity_id: 'asst_1' });
  assert.equal(r.json.message, 'success');
  assert.match(r.json.session_id, ID_RE);
  assert.equal(r.json.storage_session_id, r.json.session_id);
  assert.equal(r.json.files.length, 1);
  assert.match(r.json.files[0].fileId, ID_RE);
  assert.equal(r.json.files[0].filename, 'visits.csv');
});

test('POST /upload also at the root, without entity_id, and with several `files` parts', async () => {
  const one = await upload({ base: broker.root });
  assert.equal(one.json.message, 'success');
  const r = await call(`${broker.v1}/upload`, {
    method: 'POST',
    headers: headers(),
    body: form({}, [
      { field: 'files', name: 'a.txt', data: 'alpha\n' },
      { field: 'files', name: 'b.txt', data: 'beta\n' },
    ]),
  });
  assert.equal(r.status, 200, show(r));
  assert.deepEqual(r.json.files.map((f) => f.filename).sort(), ['a.txt', 'b.txt']);
  for (const f of r.json.files) assert.match(f.fileId, ID_RE);
});

test('GET /files/{S}?detail=summary finds the upload as LibreChat looks for it (name starts with S/F, fresh lastModified)', async () => {
  const up = await upload({ entity_id: 'asst_2' });
  const S = up.json.session_id;
  const F = up.json.files[0].fileId;
  const r = await call(`${broker.v1}/files/${S}?detail=summary&entity_id=asst_2`, { headers: headers() });
  assert.equal(r.status, 200, show(r));
  assert.ok(Array.isArray(r.json), show(r));
  const entry = r.json.find((f) => f.name.startsWith(`${S}/${F}`));
  assert.ok(entry, `no entry named ${S}/${F}…: ${show(r)}`);
  const age = Date.now() - new Date(entry.lastModified).getTime();
  assert.ok(Number.isFinite(age) && age > -60_000 && age < 60_000, `lastModified ${entry.lastModified}`);
  assert.match(entry.lastModified, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d/);
  // The same with only the key, as getSessionInfo sends it.
  const keyOnly = await call(`${broker.v1}/files/${S}?detail=summary`, { headers: headers(null) });
  assert.equal(keyOnly.status, 200, show(keyOnly));
  assert.ok(keyOnly.json.some((f) => f.name.startsWith(`${S}/${F}`)), show(keyOnly));
});

test('GET /files/{S}?detail=full: the classic client can rebuild {id, name} from name and metadata', async () => {
  const up = await upload();
  const S = up.json.session_id;
  const F = up.json.files[0].fileId;
  const r = await call(`${broker.v1}/files/${S}?detail=full`, { headers: headers(null) });
  assert.equal(r.status, 200, show(r));
  const entry = r.json.find((f) => f.id === F);
  assert.ok(entry, show(r));
  // @librechat/agents 3.0.x CodeExecutor.ts: id = name.split('/')[1].split('.')[0]
  assert.equal(entry.name.split('/')[0], S);
  assert.equal(entry.name.split('/')[1].split('.')[0], F);
  assert.equal(entry.metadata['original-filename'], 'visits.csv');
  assert.equal(entry.storage_session_id, S);
  assert.equal(entry.size, Buffer.byteLength(CSV));
  assert.match(entry.contentType, /^text\/csv/);
  for (const detail of ['simple', 'normalized']) {
    const d = await call(`${broker.v1}/files/${S}?detail=${detail}`, { headers: headers() });
    assert.equal(d.status, 200, `detail=${detail}: ${show(d)}`);
    assert.ok(Array.isArray(d.json) && d.json.length >= 1, `detail=${detail}: ${show(d)}`);
  }
});

test('GET /files: an unknown session is [], a malformed id is 400', async () => {
  const unknown = await call(`${broker.v1}/files/${randomId()}?detail=summary`, { headers: headers() });
  assert.equal(unknown.status, 200, show(unknown));
  assert.deepEqual(unknown.json, []);
  const bad = await call(`${broker.v1}/files/not.an.id?detail=summary`, { headers: headers() });
  assert.equal(bad.status, 400, show(bad));
  assert.equal(typeof bad.json?.error, 'string', show(bad));
});

test('CSV upload -> pandas on /mnt/data/<name> -> plot + CSV back -> both download byte for byte', async () => {
  const up = await upload({ entity_id: 'asst_3' });
  const S = up.json.session_id;
  const F = up.json.files[0].fileId;
  const r = await exec({
    lang: 'py',
    entity_id: 'asst_3',
    files: [{ id: F, session_id: S, name: 'visits.csv' }],
    code: `${PY_HASHES}
import pandas as pd
import matplotlib.pyplot as plt
df = pd.read_csv('/mnt/data/visits.csv')
print('mean', df.visits.mean())
df[df.visits > 100].to_csv('/mnt/data/busy_days.csv', index=False)
df.plot(x='day', y='visits')
plt.show()
import os
_hashes('busy_days.csv', *[n for n in os.listdir('/mnt/data') if n.endswith('.png')])
`,
  });
  assert.equal(r.status, 200, show(r));
  assert.equal(r.json.stderr, '', r.json.stderr);
  assert.match(r.json.stdout, /^mean 121\.2\n/);
  // An agent's files (entity_id) are shared read-only (docs/API.md, "Shared files"): the
  // exec runs in a session of the user's own, where its outputs stay.
  const X = r.json.session_id;
  assert.notEqual(X, S, 'the exec ran in the shared upload session');
  const generated = r.json.files.filter((f) => f.inherited !== true);
  const names = generated.map((f) => f.name).sort();
  assert.equal(names.length, 2, JSON.stringify(r.json.files));
  assert.equal(names[0], 'busy_days.csv');
  assert.match(names[1], /\.png$/);
  assert.ok(!generated.some((f) => f.name === 'visits.csv'), 'the unchanged input is not reported as generated');

  const hashes = parseHashes(r.json.stdout);
  for (const f of generated) {
    assert.match(f.id, ID_RE);
    const dl = await download(broker.v1, r.json.session_id, f.id, headers(null));
    if (hashes[f.name]) {
      assert.equal(dl.bytes.length, hashes[f.name][0], f.name);
      assert.equal(sha256(dl.bytes), hashes[f.name][1], f.name);
    }
    if (f.name.endsWith('.png')) {
      assert.deepEqual([...dl.bytes.subarray(0, 8)], PNG_MAGIC);
      assert.match(dl.headers.get('content-type'), /^image\/png/);
    } else {
      assert.equal(dl.text, 'day,visits\nmon,120\nwed,143\nthu,160\n');
      assert.match(dl.headers.get('content-type'), /^text\/csv/);
    }
  }
  assert.ok(hashes['busy_days.csv'], 'the CSV was hashed in the sandbox');

  // The exec's session lists the input's copy and both outputs; the upload's, the upload.
  const list = await call(`${broker.v1}/files/${X}?detail=full`, { headers: headers() });
  assert.equal(list.status, 200, show(list));
  const listed = list.json.map((e) => e.metadata?.['original-filename']).sort();
  for (const n of ['busy_days.csv', 'visits.csv', names[1]]) {
    assert.ok(listed.includes(n), `${n} not in ${JSON.stringify(listed)}`);
  }
  const shared = await call(`${broker.v1}/files/${S}?detail=full`, { headers: headers() });
  assert.deepEqual(shared.json.map((e) => e.metadata?.['original-filename']), ['visits.csv']);
  // The next call with the same refs finds the user's session again, variables too.
  const again = await exec({
    lang: 'py', entity_id: 'asst_3', files: [{ id: F, session_id: S, name: 'visits.csv' }], code: 'print(len(df))',
  });
  assert.equal(again.status, 200, show(again));
  assert.equal(again.json.session_id, X);
  assert.equal(again.json.stdout, '5\n');
});

test('a ref to an unknown file: the exec still runs and stderr names the missing input', async () => {
  const up = await upload();
  const r = await exec({
    lang: 'py',
    files: [{ id: randomId(), session_id: up.json.session_id, name: 'ghost.csv' }],
    code: 'print("ran")',
  });
  assert.equal(r.status, 200, show(r));
  assert.match(r.json.stdout, /ran/);
  assert.match(r.json.stderr, /ghost\.csv/);
});

test('DELETE /files/{S}/{F}: deleted, then 404; gone from downloads and listings', async () => {
  const up = await upload();
  const S = up.json.session_id;
  const F = up.json.files[0].fileId;
  await download(broker.v1, S, F, headers(null));
  const del = await call(`${broker.v1}/files/${S}/${F}`, { method: 'DELETE', headers: headers() });
  assert.equal(del.status, 200, show(del));
  assert.deepEqual(del.json, { message: 'File deleted successfully', session_id: S, fileId: F });
  const again = await call(`${broker.v1}/files/${S}/${F}`, { method: 'DELETE', headers: headers() });
  assert.equal(again.status, 404, show(again));
  const dl = await call(`${broker.v1}/download/${S}/${F}`, { headers: headers(null) });
  assert.equal(dl.status, 404, show(dl));
  const list = await call(`${broker.v1}/files/${S}?detail=full`, { headers: headers() });
  assert.equal(list.status, 200, show(list));
  assert.ok(!list.json.some((e) => e.id === F || e.name.startsWith(`${S}/${F}`)), show(list));
});

test('another user named by User-Id sees none of it: list [], download 404, exec with the ref 403', async () => {
  const up = await upload();
  const S = up.json.session_id;
  const F = up.json.files[0].fileId;
  const list = await call(`${broker.v1}/files/${S}?detail=summary`, { headers: headers(OTHER) });
  assert.equal(list.status, 200, show(list));
  assert.deepEqual(list.json, []);
  const dl = await call(`${broker.v1}/download/${S}/${F}`, { headers: headers(OTHER) });
  assert.equal(dl.status, 404, show(dl));
  const r = await exec({ lang: 'py', code: 'print(1)', files: [{ id: F, session_id: S, name: 'visits.csv' }] }, OTHER);
  assert.equal(r.status, 403, show(r));
  assert.equal(typeof r.json?.error, 'string', show(r));
});

test('upload without a key is 401; over the size limit is 413 JSON (sent as LibreChat sends, axios-style)', async () => {
  const noKey = await postMultipartLikeAxios(`${broker.v1}/upload`, { 'User-Agent': 'LibreChat/1.0' },
    form({}, [{ name: 'x.txt', data: 'x' }]));
  assert.equal(noKey.status, 401, show(noKey));
  assert.equal(noKey.json?.error, 'unauthorized', show(noKey));
  const big = Buffer.alloc(1536 * 1024, 0x61);
  const tooBig = await postMultipartLikeAxios(`${broker.v1}/upload`, headers(), form({}, [{ name: 'big.txt', data: big }]));
  assert.equal(tooBig.status, 413, show(tooBig));
  assert.equal(typeof tooBig.json?.error, 'string', show(tooBig));
});

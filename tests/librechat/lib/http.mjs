// Plain-HTTP helpers for the tests, and a recording proxy that sits between a real client
// and the broker so a test can say exactly what the client sent and got back.

import { createServer, request as httpRequest } from 'node:http';
import { createHash } from 'node:crypto';
import assert from 'node:assert/strict';

export const ID_RE = /^[A-Za-z0-9_-]{21}$/;

export function sha256(buf) {
  return createHash('sha256').update(buf).digest('hex');
}

/** fetch + the body read once, as text, JSON when it parses. */
export async function call(url, init = {}) {
  const res = await fetch(url, init);
  const bytes = Buffer.from(await res.arrayBuffer());
  const text = bytes.toString('utf8');
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return { status: res.status, headers: res.headers, bytes, text, json };
}

/** Formats a response for assertion messages: status and (short) body. */
export function show(r) {
  const body = r.text.length > 1500 ? `${r.text.slice(0, 1500)}…` : r.text;
  return `HTTP ${r.status} ${body}`;
}

/**
 * Downloads `/download/{session}/{file}` the way LibreChat's server does (crud.js
 * getCodeOutputDownloadStream / process.js processCodeOutput: GET with the key or token and
 * `User-Agent: LibreChat/1.0`), and checks what LibreChat relies on.
 */
export async function download(base, sessionId, fileId, headers) {
  const r = await call(`${base}/download/${sessionId}/${fileId}`, {
    headers: { 'User-Agent': 'LibreChat/1.0', ...headers },
  });
  assert.equal(r.status, 200, `download ${sessionId}/${fileId}: ${show(r)}`);
  const cd = r.headers.get('content-disposition') ?? '';
  assert.match(cd, /^attachment\b/, `Content-Disposition is ${JSON.stringify(cd)}`);
  return r;
}

/** Multipart upload with the form fields in the order given (LibreChat appends fields before the file). */
export function form(fields, files) {
  const fd = new FormData();
  for (const [k, v] of Object.entries(fields)) {
    if (v !== undefined) fd.append(k, String(v));
  }
  for (const f of files) {
    fd.append(f.field ?? 'file', new Blob([f.data], { type: f.type ?? 'application/octet-stream' }), f.name);
  }
  return fd;
}

/**
 * A transparent HTTP proxy to `target` that records every exchange:
 * { method, url, headers, body (parsed JSON or text), status, response (parsed) }, and
 * `aborted: true` (status 499) when the client went away before the answer.
 */
export async function recordingProxy(target) {
  const t = new URL(target);
  const log = [];
  const server = createServer((req, res) => {
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => {
      const reqBody = Buffer.concat(chunks);
      const entry = { method: req.method, url: req.url, headers: req.headers, body: parse(reqBody) };
      log.push(entry);
      const up = httpRequest(
        { host: t.hostname, port: t.port, method: req.method, path: req.url, headers: req.headers },
        (upRes) => {
          res.writeHead(upRes.statusCode, upRes.headers);
          const out = [];
          upRes.on('data', (c) => {
            out.push(c);
            res.write(c);
          });
          upRes.on('end', () => {
            entry.status = upRes.statusCode;
            entry.response = parse(Buffer.concat(out));
            res.end();
          });
        },
      );
      up.on('error', (err) => {
        if (entry.status !== undefined) return;
        entry.status = entry.aborted ? 499 : 502;
        entry.response = String(err);
        if (!res.headersSent) res.writeHead(502).end(String(err));
      });
      // A client that goes away before its answer: the broker sees the connection close
      // too, as it would without the proxy (a programmatic run stops when its client goes).
      res.on('close', () => {
        if (!res.writableFinished) {
          entry.aborted = true;
          up.destroy();
        }
      });
      up.end(reqBody);
    });
  });
  await new Promise((r) => server.listen(0, '127.0.0.1', r));
  const { port } = server.address();
  return {
    url: `http://127.0.0.1:${port}`,
    log,
    /** Entries since `mark` (an index from `log.length`). */
    since(mark) {
      return log.slice(mark);
    },
    close: () => new Promise((r) => server.close(r)),
  };
}

function parse(buf) {
  const text = buf.toString('utf8');
  if (text.trim() === '') return text;
  try {
    return JSON.parse(text);
  } catch {
    return text.length > 2000 ? `${text.slice(0, 2000)}…` : text;
  }
}

/** Python that prints a JSON line {name: [size, sha256]} for files under /mnt/data, to compare downloads byte for byte. */
export const PY_HASHES = `
import hashlib as _h, json as _j, os as _o
def _hashes(*names):
    out = {}
    for n in names:
        p = _o.path.join('/mnt/data', n)
        with open(p, 'rb') as f:
            b = f.read()
        out[n] = [len(b), _h.sha256(b).hexdigest()]
    print('HASHES ' + _j.dumps(out))
`;

/** The {name: [size, sha256]} printed by PY_HASHES' _hashes(...). */
export function parseHashes(stdout) {
  const line = stdout.split('\n').find((l) => l.startsWith('HASHES '));
  assert.ok(line, `no HASHES line in stdout: ${stdout}`);
  return JSON.parse(line.slice('HASHES '.length));
}

/** One turn of a data-analysis chat: a global, a pandas CSV and a matplotlib plot via plt.show(). */
export const PY_PLOT_AND_CSV = `${PY_HASHES}
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

/** The next turn: what is in /mnt/data, the CSV's last line, and whether the global survived. */
export const PY_NEXT_TURN =
  "import os\nprint(sorted(n for n in os.listdir('/mnt/data') if not n.startswith('.')))\nprint(open('/mnt/data/squares.csv').read().splitlines()[-1])\nprint(globals().get('secret', 'state-lost'))";

export const SQUARES_CSV = 'x,y\n1,1\n2,4\n3,9\n4,16\n';

export const PNG_MAGIC = [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a];

/**
 * Sends a FormData the way LibreChat's server does (axios + form-data over node:http: the
 * whole multipart body with a Content-Length, headers and body written together), and
 * reads the answer even when the server answers before it has read the body.
 * Node's fetch streams the body after the headers instead, and sees EPIPE when the server
 * answers early (401, 413) and closes.
 */
export async function postMultipartLikeAxios(url, headers, fd) {
  const req = new Request(url, { method: 'POST', body: fd });
  const body = Buffer.from(await req.arrayBuffer());
  const u = new URL(url);
  return new Promise((resolveRes, reject) => {
    const r = httpRequest(
      {
        host: u.hostname,
        port: u.port,
        path: u.pathname + u.search,
        method: 'POST',
        headers: { ...headers, 'content-type': req.headers.get('content-type'), 'content-length': body.length },
      },
      (res) => {
        const chunks = [];
        res.on('data', (c) => chunks.push(c));
        res.on('end', () => {
          const bytes = Buffer.concat(chunks);
          const text = bytes.toString('utf8');
          let json;
          try {
            json = JSON.parse(text);
          } catch {
            json = undefined;
          }
          resolveRes({ status: res.statusCode, headers: new Headers(res.headers), bytes, text, json });
        });
      },
    );
    r.on('error', reject);
    r.end(body);
  });
}

// Starts one codebroker binary for a test file, the way an operator would run it next to
// LibreChat, and removes everything it made when the file is done.
//
//   const broker = await startBroker({ jwt: true });
//   ... broker.v1 (LibreChat's base URL), broker.apiKey, broker.mintJwt(user) ...
//   await broker.stop();
//
// The binary is ../../target/debug/codebroker (built by `make librechat-test`), or
// CODEBROKER_BIN. Each test file runs in its own process, so each gets its own broker,
// instance label (librechat-test-<pid>) and data directory.

import { spawn, execFile, execFileSync } from 'node:child_process';
import { createServer } from 'node:net';
import { mkdtemp, rm, writeFile, readFile } from 'node:fs/promises';
import { openSync, closeSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomBytes, generateKeyPairSync, sign as cryptoSign, randomUUID } from 'node:crypto';
import { promisify } from 'node:util';

const execFileP = promisify(execFile);
const PKG_DIR = resolve(dirname(fileURLToPath(import.meta.url)), '..');

/** LibreChat's default `kid` for the tokens it mints (packages/api/src/auth/codeapi.ts). */
export const LIBRECHAT_DEFAULT_KID = 'lc-codeapi-2026-05';

async function freePort() {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolvePort(port));
    });
  });
}

// Brokers still running when this process ends (a crash, an interrupt, a runner timeout):
// killed, and their containers and data removed, synchronously on the way out.
const running = new Map();
process.once('exit', () => {
  for (const [child, { instance, dataDir }] of running) {
    try {
      child.kill('SIGKILL');
    } catch {
      /* already gone */
    }
    try {
      const ids = execFileSync('docker', ['ps', '-aq', '--filter', `label=codebroker.instance=${instance}`], { encoding: 'utf8' })
        .split(/\s+/)
        .filter(Boolean);
      if (ids.length > 0) execFileSync('docker', ['rm', '-f', ...ids], { stdio: 'ignore' });
    } catch {
      /* best effort */
    }
    rmSync(dataDir, { recursive: true, force: true });
  }
});
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.once(sig, () => process.exit(128 + ({ SIGHUP: 1, SIGINT: 2, SIGTERM: 15 })[sig]));
}

function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

function base64Url(value) {
  return Buffer.from(value).toString('base64url');
}

/**
 * A token shaped like the ones LibreChat (v0.8.5+) mints for its code API calls:
 * EdDSA, header `kid`, claims iss/aud/sub/iat/nbf/exp/jti/tenant_id (+ role, principal
 * source, context hash, which the broker may ignore).
 */
export function mintLibreChatJwt({ privateKey, kid = LIBRECHAT_DEFAULT_KID, sub, ttl = 300, iss = 'librechat', aud = 'codeapi' }) {
  const now = Math.floor(Date.now() / 1000);
  const header = { alg: 'EdDSA', typ: 'JWT', kid };
  const claims = {
    iss,
    aud,
    sub,
    iat: now,
    nbf: now,
    exp: now + ttl,
    jti: randomUUID(),
    tenant_id: 'legacy',
    role: 'USER',
    principal_source: 'librechat_jwt',
    auth_context_hash: randomBytes(32).toString('hex'),
  };
  const input = `${base64Url(JSON.stringify(header))}.${base64Url(JSON.stringify(claims))}`;
  const signature = cryptoSign(null, Buffer.from(input), privateKey);
  return `${input}.${base64Url(signature)}`;
}

// Brokers started by this process so far: the first is librechat-test-<pid>, later ones
// (a file that needs a second broker, e.g. one without auth) get -2, -3, ... so that
// stopping one never removes the other's containers.
let brokersStarted = 0;

/**
 * @param {object} [opts]
 * @param {boolean} [opts.jwt] also trust an Ed25519 key (generated here) for LibreChat JWTs
 * @param {'key'|'none'} [opts.auth] `none` starts the broker with CODEBROKER_AUTH=none (and no
 *   key), for a client generation that sends no credentials at all
 * @param {Record<string,string>} [opts.env] extra CODEBROKER_* settings
 */
export async function startBroker(opts = {}) {
  const bin = process.env.CODEBROKER_BIN
    ? resolve(process.env.CODEBROKER_BIN)
    : resolve(PKG_DIR, '../../target/debug/codebroker');
  const port = await freePort();
  const apiKey = randomBytes(24).toString('hex');
  const dataDir = await mkdtemp(join(tmpdir(), 'codebroker-librechat-'));
  brokersStarted += 1;
  const instance = `librechat-test-${process.pid}${brokersStarted > 1 ? `-${brokersStarted}` : ''}`;
  const env = {
    ...process.env,
    CODEBROKER_LISTEN: `127.0.0.1:${port}`,
    ...(opts.auth === 'none' ? { CODEBROKER_AUTH: 'none' } : { CODEBROKER_API_KEY: apiKey }),
    CODEBROKER_DATA_DIR: join(dataDir, 'data'),
    CODEBROKER_INSTANCE: instance,
    CODEBROKER_POOL_SIZE: '1',
    ...(opts.env ?? {}),
  };

  let jwtKeys = null;
  if (opts.jwt) {
    const { privateKey, publicKey } = generateKeyPairSync('ed25519');
    const pubPath = join(dataDir, 'librechat-jwt.pub.pem');
    await writeFile(pubPath, publicKey.export({ type: 'spki', format: 'pem' }));
    env.CODEBROKER_JWT_PUBLIC_KEYS = `${LIBRECHAT_DEFAULT_KID}=${pubPath}`;
    jwtKeys = { privateKey, kid: LIBRECHAT_DEFAULT_KID };
  }

  const logPath = join(dataDir, 'broker.log');
  const logFd = openSync(logPath, 'a');
  const child = spawn(bin, [], { env, stdio: ['ignore', logFd, logFd] });
  closeSync(logFd);
  running.set(child, { instance, dataDir });
  let exited = null;
  const exitPromise = new Promise((r) => {
    child.on('exit', (code, signal) => {
      exited = { code, signal };
      r(exited);
    });
    child.on('error', (err) => {
      exited = { error: err };
      r(exited);
    });
  });

  const root = `http://127.0.0.1:${port}`;
  const log = async () => {
    try {
      const text = await readFile(logPath, 'utf8');
      return text.split('\n').slice(-60).join('\n');
    } catch {
      return '';
    }
  };

  const stop = async () => {
    if (!exited) {
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 15_000);
      await exitPromise;
      clearTimeout(timer);
    }
    await removeContainers(instance);
    running.delete(child);
    if (process.env.KEEP_BROKER_DATA) {
      process.stderr.write(`broker data kept in ${dataDir}\n`);
    } else {
      await rm(dataDir, { recursive: true, force: true }).catch(() => {});
    }
  };

  // The first start may create the pool's container; allow a minute.
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (exited) {
      const tail = await log();
      await stop();
      throw new Error(`codebroker (${bin}) exited before it was healthy: ${JSON.stringify(exited)}\n${tail}`);
    }
    try {
      const res = await fetch(`${root}/health`);
      if (res.ok) {
        await res.arrayBuffer();
        break;
      }
    } catch {
      /* not listening yet */
    }
    if (Date.now() > deadline) {
      const tail = await log();
      await stop();
      throw new Error(`codebroker did not answer GET /health within 60 s\n${tail}`);
    }
    await sleep(200);
  }

  return {
    root,
    /** LibreChat's LIBRECHAT_CODE_BASEURL: its default ends in /v1. */
    v1: `${root}/v1`,
    apiKey,
    instance,
    dataDir,
    log,
    stop,
    jwtKeys,
    mintJwt(sub, extra = {}) {
      if (!jwtKeys) throw new Error('broker started without jwt: true');
      return mintLibreChatJwt({ ...jwtKeys, sub, ...extra });
    },
  };
}

/** `docker ps -aq --filter label=codebroker.instance=<instance> | xargs docker rm -f` */
export async function removeContainers(instance) {
  try {
    const { stdout } = await execFileP('docker', ['ps', '-aq', '--filter', `label=codebroker.instance=${instance}`]);
    const ids = stdout.split(/\s+/).filter(Boolean);
    if (ids.length > 0) {
      await execFileP('docker', ['rm', '-f', ...ids]);
    }
  } catch (err) {
    process.stderr.write(`could not remove containers of ${instance}: ${err.message}\n`);
  }
}

// Starts one codebroker binary for a test file, as an operator would run it, and removes
// everything it made when the file is done. The one launcher of the Node suites
// (tests/lobe, tests/playground, tests/librechat); it needs nothing but node's own modules.
//
// The binary is target/debug/codebroker (built by the suite's make target), or
// CODEBROKER_BIN. The instance label is <name>-test-<pid>-<n>; the data directory is
// temporary (kept when KEEP_BROKER_DATA is set). `startBroker({ auth: 'none' })` runs
// without a key.

import { spawn, execFileSync } from 'node:child_process';
import { createServer } from 'node:net';
import { mkdtemp, rm, readFile, writeFile } from 'node:fs/promises';
import { openSync, closeSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { randomBytes, generateKeyPairSync } from 'node:crypto';

const REPO_DIR = resolve(dirname(fileURLToPath(import.meta.url)), '../..');
let started = 0;

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

/**
 * The Docker label of an instance's sandboxes: on the Kubernetes backend (`make test-k8s`)
 * they are pods, which the stand-in API server (tests/k8s_standin) runs as containers with
 * the pod's labels copied under a prefix of its own.
 */
const INSTANCE_LABEL = /^kubernetes$/i.test(process.env.CODEBROKER_BACKEND ?? '')
  ? 'k8s-standin.pod-label.codebroker.instance'
  : 'codebroker.instance';

/** `docker ps -aq --filter label=<instance label>=<instance> | xargs docker rm -f` */
export function removeContainers(instance) {
  try {
    const ids = execFileSync('docker', ['ps', '-aq', '--filter', `label=${INSTANCE_LABEL}=${instance}`], {
      encoding: 'utf8',
    })
      .split(/\s+/)
      .filter(Boolean);
    if (ids.length > 0) execFileSync('docker', ['rm', '-f', ...ids], { stdio: 'ignore' });
  } catch (err) {
    process.stderr.write(`could not remove containers of ${instance}: ${err.message}\n`);
  }
}

// A broker still running when this process ends (a crash, an interrupt) is killed and
// its containers and data removed on the way out.
const running = new Map();
process.once('exit', () => {
  for (const [child, { instance, dataDir }] of running) {
    try {
      child.kill('SIGKILL');
    } catch {
      /* already gone */
    }
    removeContainers(instance);
    rmSync(dataDir, { recursive: true, force: true });
  }
});
for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) {
  process.once(sig, () => process.exit(128 + { SIGHUP: 1, SIGINT: 2, SIGTERM: 15 }[sig]));
}

/**
 * A broker on a free loopback port; with a random API key unless `auth: 'none'`.
 *
 * @param {object} [opts]
 * @param {string} [opts.name] the suite's name, in the instance label and the data directory
 * @param {'key'|'none'} [opts.auth] `none` runs without credentials (and no key)
 * @param {string} [opts.poolSize] CODEBROKER_POOL_SIZE
 * @param {boolean} [opts.publicUrl] set CODEBROKER_PUBLIC_URL to the broker's own address
 * @param {string} [opts.jwtKid] also trust an Ed25519 key generated here, under this `kid`,
 *   for JWTs; its private half comes back as `jwtKeys`
 * @param {Record<string,string>} [opts.env] extra CODEBROKER_* settings
 */
export async function startBroker({
  name = 'node',
  auth = 'key',
  poolSize = '0',
  publicUrl = true,
  jwtKid = null,
  env: extraEnv = {},
} = {}) {
  const bin = process.env.CODEBROKER_BIN
    ? resolve(process.env.CODEBROKER_BIN)
    : resolve(REPO_DIR, 'target/debug/codebroker');
  const port = await freePort();
  const root = `http://127.0.0.1:${port}`;
  const apiKey = auth === 'none' ? '' : randomBytes(24).toString('hex');
  const dataDir = await mkdtemp(join(tmpdir(), `codebroker-${name}-`));
  const instance = `${name}-test-${process.pid}-${started++}`;
  const env = {
    ...process.env,
    CODEBROKER_LISTEN: `127.0.0.1:${port}`,
    CODEBROKER_AUTH: auth,
    CODEBROKER_API_KEY: apiKey,
    CODEBROKER_DATA_DIR: join(dataDir, 'data'),
    CODEBROKER_INSTANCE: instance,
    CODEBROKER_POOL_SIZE: poolSize,
    ...(publicUrl ? { CODEBROKER_PUBLIC_URL: root } : {}),
    ...extraEnv,
  };
  let jwtKeys = null;
  if (jwtKid) {
    const { privateKey, publicKey } = generateKeyPairSync('ed25519');
    const pubPath = join(dataDir, 'jwt.pub.pem');
    await writeFile(pubPath, publicKey.export({ type: 'spki', format: 'pem' }));
    env.CODEBROKER_JWT_PUBLIC_KEYS = `${jwtKid}=${pubPath}`;
    jwtKeys = { privateKey, kid: jwtKid };
  }
  const logPath = join(dataDir, 'broker.log');
  const logFd = openSync(logPath, 'a');
  const child = spawn(bin, [], { env, stdio: ['ignore', logFd, logFd] });
  closeSync(logFd);
  running.set(child, { instance, dataDir });
  let exited = null;
  const exitPromise = new Promise((r) => {
    child.on('exit', (code, signal) => r((exited = { code, signal })));
    child.on('error', (error) => r((exited = { error: error.message })));
  });
  const log = async () => (await readFile(logPath, 'utf8').catch(() => '')).split('\n').slice(-60).join('\n');
  const stop = async () => {
    if (!exited) {
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), 15_000);
      await exitPromise;
      clearTimeout(timer);
    }
    removeContainers(instance);
    running.delete(child);
    if (process.env.KEEP_BROKER_DATA) {
      process.stderr.write(`broker data kept in ${dataDir}\n`);
    } else {
      await rm(dataDir, { recursive: true, force: true }).catch(() => {});
    }
  };

  const deadline = Date.now() + 60_000;
  for (;;) {
    if (exited) {
      const tail = await log();
      await stop();
      throw new Error(`codebroker (${bin}) exited before it was healthy: ${JSON.stringify(exited)}\n${tail}`);
    }
    try {
      const res = await fetch(`${root}/health`);
      await res.arrayBuffer();
      if (res.ok) break;
    } catch {
      /* not listening yet */
    }
    if (Date.now() > deadline) {
      const tail = await log();
      await stop();
      throw new Error(`codebroker did not answer GET /health within 60 s\n${tail}`);
    }
    await new Promise((r) => setTimeout(r, 200));
  }
  return { root, apiKey, instance, dataDir, log, stop, jwtKeys };
}

// The broker for the LibreChat suite, as an operator would run it next to LibreChat: the
// shared launcher (tests/node-common) with one warm sandbox, no CODEBROKER_PUBLIC_URL, and
// LibreChat's JWTs.
//
//   const broker = await startBroker({ jwt: true });
//   ... broker.v1 (LibreChat's base URL), broker.apiKey, broker.mintJwt(user) ...
//   await broker.stop();
//
// The binary is ../../target/debug/codebroker (built by `make librechat-test`), or
// CODEBROKER_BIN. Each test file runs in its own process, so each gets its own broker,
// instance label (librechat-test-<pid>-<n>) and data directory.

import { randomBytes, sign as cryptoSign, randomUUID } from 'node:crypto';
import { startBroker as start, removeContainers } from '../../node-common/broker.mjs';

export { removeContainers };

/** LibreChat's default `kid` for the tokens it mints (packages/api/src/auth/codeapi.ts). */
export const LIBRECHAT_DEFAULT_KID = 'lc-codeapi-2026-05';

function base64Url(value) {
  return Buffer.from(value).toString('base64url');
}

/**
 * A token shaped like the ones LibreChat (v0.8.5+) mints for its code API calls:
 * EdDSA, header `kid`, claims iss/aud/sub/iat/nbf/exp/jti/tenant_id (+ role, principal
 * source, context hash, which the broker may ignore). `tenant_id` decides who shares skill
 * and agent files.
 */
export function mintLibreChatJwt({ privateKey, kid = LIBRECHAT_DEFAULT_KID, sub, ttl = 300, iss = 'librechat', aud = 'codeapi', tenant_id = 'legacy' }) {
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
    // 'legacy': LibreChat's default without a tenant of its own.
    tenant_id,
    role: 'USER',
    principal_source: 'librechat_jwt',
    auth_context_hash: randomBytes(32).toString('hex'),
  };
  const input = `${base64Url(JSON.stringify(header))}.${base64Url(JSON.stringify(claims))}`;
  const signature = cryptoSign(null, Buffer.from(input), privateKey);
  return `${input}.${base64Url(signature)}`;
}

/**
 * @param {object} [opts]
 * @param {boolean} [opts.jwt] also trust an Ed25519 key (generated here) for LibreChat JWTs
 * @param {'key'|'none'} [opts.auth] `none` starts the broker with CODEBROKER_AUTH=none (and no
 *   key), for a client generation that sends no credentials at all
 * @param {Record<string,string>} [opts.env] extra CODEBROKER_* settings
 */
export async function startBroker(opts = {}) {
  const broker = await start({
    name: 'librechat',
    auth: opts.auth === 'none' ? 'none' : 'key',
    poolSize: '1',
    publicUrl: false,
    jwtKid: opts.jwt ? LIBRECHAT_DEFAULT_KID : null,
    env: opts.env ?? {},
  });
  return {
    ...broker,
    /** LibreChat's LIBRECHAT_CODE_BASEURL: its default ends in /v1. */
    v1: `${broker.root}/v1`,
    mintJwt(sub, extra = {}) {
      if (!broker.jwtKeys) throw new Error('broker started without jwt: true');
      return mintLibreChatJwt({ ...broker.jwtKeys, sub, ...extra });
    },
  };
}

// The code-API calls LibreChat's own server makes around the agents package, made the way
// it makes them: axios and form-data (LibreChat's server depends on both), the same
// routes, fields, headers and checks of the answer. LibreChat's server itself is not a
// package that can be installed here, so these follow its source:
//
//   batchUploadCodeEnvFiles   api/server/services/Files/Code/crud.js: POST /upload/batch,
//                             fields kind, id, version (skills), read_only, then the files
//                             (form-data's `filepath` keeps the nested name); headers
//                             User-Agent, User-Id and the auth headers
//   uploadCodeEnvFile         the same form to POST /upload, without read_only
//   getCodeFileInfo           packages/api/src/files/code/priming.ts (and process.js
//                             getSessionInfo): GET /sessions/{S}/objects/{F}?kind&id&version,
//                             reads lastModified and originalFilename; any error is a miss
//   checkCodeFileActive       lastModified under 23 h old
//   checkSessionsAlive        packages/api/src/files/provision/service.ts: GET
//                             /files/{S}?detail=summary, alive when an item's fileId is F;
//                             404 is "expired", other errors "unknown"
//
// `baseURL` may carry credentials (`http://<key>@host/v1`): axios then sends them as HTTP
// Basic, as it does for LibreChat's server.

import axios from 'axios';
import FormData from 'form-data';
import { basename } from 'node:path';

const agent = axios.create({ validateStatus: () => true, maxBodyLength: Infinity, maxContentLength: Infinity });

function identityFields(form, { kind, id, version }) {
  form.append('kind', kind);
  form.append('id', id);
  if (kind === 'skill') form.append('version', String(version));
}

/** @returns {Promise<{status:number, data:any, sent:object}>} */
export async function batchUploadCodeEnvFiles({ baseURL, headers = {}, userId, files, kind, id, version, read_only = false }) {
  const form = new FormData();
  identityFields(form, { kind, id, version });
  if (read_only) form.append('read_only', 'true');
  for (const f of files) {
    form.append('file', Buffer.from(f.data), { filename: basename(f.name), filepath: f.name });
  }
  const res = await agent.post(`${baseURL}/upload/batch`, form, {
    headers: { ...form.getHeaders(), 'Content-Type': 'multipart/form-data', 'User-Agent': 'LibreChat/1.0', 'User-Id': userId, ...headers },
  });
  return { status: res.status, data: res.data, sent: res.request.getHeaders() };
}

export async function uploadCodeEnvFile({ baseURL, headers = {}, userId, file, kind, id, version, fields = {} }) {
  const form = new FormData();
  if (kind) identityFields(form, { kind, id, version });
  for (const [k, v] of Object.entries(fields)) form.append(k, v);
  form.append('file', Buffer.from(file.data), { filename: basename(file.name), filepath: file.name });
  const res = await agent.post(`${baseURL}/upload`, form, {
    headers: { ...form.getHeaders(), 'Content-Type': 'multipart/form-data', 'User-Agent': 'LibreChat/1.0', 'User-Id': userId, ...headers },
  });
  return { status: res.status, data: res.data, sent: res.request.getHeaders() };
}

/** `{ lastModified, originalFilename }`, or `null` for a miss (any error, 404 included). */
export async function getCodeFileInfo({ baseURL, headers = {}, ref }) {
  const query = new URLSearchParams({ kind: ref.kind, id: ref.resource_id });
  if (ref.version != null) query.set('version', String(ref.version));
  const res = await agent.get(`${baseURL}/sessions/${ref.storage_session_id}/objects/${ref.id}?${query}`, {
    headers: { 'User-Agent': 'LibreChat/1.0', ...headers },
  });
  if (res.status !== 200) return null;
  return { lastModified: res.data?.lastModified, originalFilename: res.data?.originalFilename };
}

export function checkCodeFileActive(lastModified) {
  return (Date.now() - new Date(lastModified).getTime()) / 3_600_000 < 23;
}

/** 'alive', 'expired' (404 or not listed) or 'unknown' (another error). */
export async function checkSessionsAlive({ baseURL, headers = {}, ref }) {
  const res = await agent.get(`${baseURL}/files/${ref.storage_session_id}?detail=summary`, {
    headers: { 'User-Agent': 'LibreChat/1.0', ...headers },
  });
  if (res.status === 404) return 'expired';
  if (res.status !== 200) return 'unknown';
  return Array.isArray(res.data) && res.data.some((f) => f.fileId === ref.id) ? 'alive' : 'expired';
}

/**
 * LibreChat's skill priming decision (packages/api/src/agents/skillFiles.ts): reuse the
 * stored refs when every distinct storage session answers a fresh lastModified, else
 * upload again. Returns whether the refs were reused.
 */
export async function primedRefsAreFresh({ baseURL, headers, refs }) {
  const bySession = new Map(refs.map((r) => [r.storage_session_id, r]));
  for (const ref of bySession.values()) {
    const info = await getCodeFileInfo({ baseURL, headers, ref });
    if (!info?.lastModified || !checkCodeFileActive(info.lastModified)) return false;
  }
  return true;
}

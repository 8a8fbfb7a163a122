// codebroker's LobeChat plugin checked by LobeChat's own code: the manifest against
// `pluginManifestSchema` (@lobehub/chat-plugin-sdk), and runCode called through the plugin
// gateway LobeChat runs (@lobehub/chat-plugins-gateway `Gateway.execute`), which validates
// the manifest, the user's settings and the model's arguments against the manifest's
// schemas, then POSTs the arguments to the api url with the settings in
// X-Lobe-Plugin-Settings.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { startBroker } from '../lib/broker.mjs';

const require = createRequire(import.meta.url);
const { pluginManifestSchema, PluginErrorType } = require('@lobehub/chat-plugin-sdk');
const { Gateway } = require('@lobehub/chat-plugins-gateway');

let broker;
let manifest;

before(async () => {
  broker = await startBroker();
  // Public: LobeChat fetches it from the browser or its server without credentials.
  const res = await fetch(`${broker.root}/lobe/manifest.json`);
  assert.equal(res.status, 200);
  manifest = await res.json();
});

after(async () => {
  await broker?.stop();
});

/** runCode as LobeChat calls it: through its gateway, with the user's plugin settings. */
async function runCode(args, settings) {
  const gateway = new Gateway();
  try {
    return await gateway.execute(
      { identifier: manifest.identifier, apiName: 'runCode', arguments: JSON.stringify(args), manifest },
      settings,
    );
  } catch (failure) {
    // The gateway throws {success: false, errorType, body}.
    return failure;
  }
}

function sessionOf(markdown) {
  const match = /session_id: `([A-Za-z0-9_-]{21})`/.exec(markdown);
  assert.ok(match, `no session_id in ${markdown}`);
  return match[1];
}

test('the manifest passes pluginManifestSchema', () => {
  const parsed = pluginManifestSchema.safeParse(manifest);
  assert.ok(parsed.success, JSON.stringify(parsed.error?.issues));
  assert.equal(parsed.data.api[0].name, 'runCode');
  assert.equal(parsed.data.api[0].url, `${broker.root}/lobe/run`);
  // (zod's parse keeps only the keys the schema names, so the properties are read raw.)
  assert.deepEqual(Object.keys(manifest.api[0].parameters.properties).sort(), ['code', 'lang', 'session_id']);
  assert.deepEqual(manifest.settings.required, ['apiKey']);
});

test('runCode through the gateway returns markdown with the output and the session', async () => {
  const settings = { apiKey: broker.apiKey };
  const first = await runCode({ lang: 'py', code: "x = 20\nprint('sum', x + 22)" }, settings);
  assert.equal(first.success, true, JSON.stringify(first));
  assert.match(first.data, /```text\nsum 42\n```/);
  const session = sessionOf(first.data);

  const second = await runCode({ lang: 'py', code: 'print(x)', session_id: session }, settings);
  assert.equal(second.success, true, JSON.stringify(second));
  assert.match(second.data, /```text\n20\n```/);
  assert.equal(sessionOf(second.data), session);
});

test('a plot comes back as a markdown image that downloads', async () => {
  const settings = { apiKey: broker.apiKey };
  const res = await runCode(
    { lang: 'py', code: 'import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()' },
    settings,
  );
  assert.equal(res.success, true, JSON.stringify(res));
  const image = /!\[[^\]]*\.png\]\((http[^)]+)\)/.exec(res.data);
  assert.ok(image, res.data);
  assert.ok(image[1].startsWith(`${broker.root}/download/`), image[1]);
  const download = await fetch(image[1], { headers: { 'X-API-Key': broker.apiKey } });
  assert.equal(download.status, 200);
  const bytes = Buffer.from(await download.arrayBuffer());
  assert.deepEqual([...bytes.subarray(0, 4)], [0x89, 0x50, 0x4e, 0x47]);
});

test('the gateway refuses missing settings, the broker a wrong key', async () => {
  const missing = await runCode({ lang: 'py', code: 'print(1)' }, {});
  assert.equal(missing.success, false);
  assert.equal(missing.errorType, PluginErrorType.PluginSettingsInvalid);

  const wrong = await runCode({ lang: 'py', code: 'print(1)' }, { apiKey: 'wrong' });
  assert.equal(wrong.success, false);
  assert.equal(wrong.errorType, 401, JSON.stringify(wrong));
});

test('arguments outside the schema are refused before they reach the broker', async () => {
  const res = await runCode({ lang: 'cobol', code: 'x' }, { apiKey: broker.apiKey });
  assert.equal(res.success, false);
  assert.equal(res.errorType, PluginErrorType.PluginApiParamsError);
});

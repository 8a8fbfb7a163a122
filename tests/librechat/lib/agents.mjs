// Loads one installed generation of @librechat/agents (the package LibreChat's server
// runs its execute_code tool from) together with the @langchain/core copy that generation
// was built against, so its ToolNode recognises the messages we hand it.
//
// Everything is loaded through the ESM builds, as LibreChat's server loads them: the CJS
// builds wrap `node-fetch` (v3, ESM-only, hoisted from another dependency because the
// package does not declare it) so that `fetch` is not a function under Node 20's
// require(esm). Set LIBRECHAT_CODE_BASEURL before loading: the classic generation reads it
// once, when the module loads.

import { createRequire } from 'node:module';
import { readFileSync, existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

const req = createRequire(import.meta.url);

function packageRoot(file, name) {
  let dir = dirname(file);
  while (dir !== dirname(dir)) {
    const pj = join(dir, 'package.json');
    if (existsSync(pj)) {
      const p = JSON.parse(readFileSync(pj, 'utf8'));
      if (p.name === name) return { dir, pkg: p };
    }
    dir = dirname(dir);
  }
  throw new Error(`no package.json of ${name} above ${file}`);
}

function esmEntry(root, pkg, subpath) {
  let target = pkg.exports?.[subpath]?.import ?? pkg.exports?.[subpath];
  if (typeof target === 'object' && target) target = target.default;
  if (typeof target !== 'string') throw new Error(`${pkg.name} has no ESM export ${subpath}`);
  return pathToFileURL(join(root, target)).href;
}

export async function loadAgents(name) {
  const cjsEntry = req.resolve(name);
  const { dir, pkg } = packageRoot(cjsEntry, '@librechat/agents');
  const agents = await import(esmEntry(dir, pkg, '.'));
  const core = packageRoot(createRequire(cjsEntry).resolve('@langchain/core/messages'), '@langchain/core');
  const messages = await import(esmEntry(core.dir, core.pkg, './messages'));
  const tools = await import(esmEntry(core.dir, core.pkg, './tools'));
  return { agents, messages, tools, version: pkg.version, coreVersion: core.pkg.version };
}

/**
 * Runs one tool call through a ToolNode the way LibreChat's agent graph does: the model's
 * AIMessage with `tool_calls` goes in, the ToolMessage (content + artifact) comes out, and
 * the node's `sessions` map carries the code session into the next call. `nodeOptions` go
 * to the ToolNode as well (e.g. the `toolRegistry` whose `allowed_callers` decide which
 * tools a programmatic run may call); `config` of `run` goes to `invoke` (e.g. `signal`).
 */
export function toolRunner({ agents, messages }, tools, sessions = new Map(), nodeOptions = {}) {
  const node = new agents.ToolNode({ tools, sessions, ...nodeOptions });
  let n = 0;
  return {
    sessions,
    async run(name, args, config) {
      const id = `call_${Date.now()}_${++n}`;
      const ai = new messages.AIMessage({ content: '', tool_calls: [{ id, name, args, type: 'tool_call' }] });
      const out = await node.invoke({ messages: [ai] }, config);
      const list = Array.isArray(out) ? out : out.messages;
      const msg = list.find((m) => m.tool_call_id === id);
      if (!msg) throw new Error(`ToolNode returned no ToolMessage for ${id}: ${JSON.stringify(out)}`);
      return msg;
    },
  };
}

/** The text of a ToolMessage's content. */
export function contentText(msg) {
  if (typeof msg.content === 'string') return msg.content;
  return msg.content.map((c) => (typeof c === 'string' ? c : (c.text ?? ''))).join('');
}

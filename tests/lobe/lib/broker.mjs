// The broker for the LobeChat suite, as an operator would run it for LobeChat: the shared
// launcher (a random API key, CODEBROKER_PUBLIC_URL its own address), with this suite's names.
import { startBroker as start } from '../../node-common/broker.mjs';

/** A broker with a random API key whose CODEBROKER_PUBLIC_URL is its own address. */
export const startBroker = (options = {}) => start({ name: 'lobe', ...options });
